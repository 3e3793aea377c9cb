package cdc

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/replicatest"
)

// TestMain shares one primary and one streaming replica between the
// tests; each test uses its own database. Tests that pause replay do not
// run in parallel.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{Replicas: 1}),
		// pgtest's signal handler lives as long as the process.
		goleak.IgnoreTopFunction("os/signal.signal_recv"),
		goleak.IgnoreTopFunction("os/signal.loop"),
	)
}

// env is one test's database on the shared cluster, with a table the
// changes go into.
type env struct{ *replicatest.DB }

func setup(t *testing.T) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e := &env{replicatest.New(t)}
	_, err := e.Primary.Exec(ctx, "CREATE TABLE cdc (id bigint PRIMARY KEY)")
	require.NoError(t, err)
	require.NoError(t, e.Cluster.WaitReplicasCaughtUp(ctx))
	t.Cleanup(func() { _ = e.ReplicaNode.ResumeReplay(context.Background()) })
	return e
}
