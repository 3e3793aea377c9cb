package pgtest_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helperMain(mode))
	}
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{Logf: verboseLogf}))
}

// verboseLogf shows the shared cluster's progress under -v only; it outlives
// any single test, so it cannot use t.Logf.
func verboseLogf(format string, args ...any) {
	if testing.Verbose() {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
	}
}

// setup returns the shared cluster, a fresh database on it and a context
// bounded well below the package's time budget.
func setup(t *testing.T) (*pgtest.Cluster, string, context.Context) {
	t.Helper()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c, db, ctx
}

// ownCluster starts a cluster for t alone, for tests that stop, kill or
// promote its nodes, and closes it when t ends.
func ownCluster(ctx context.Context, t *testing.T, replicas int) *pgtest.Cluster {
	t.Helper()
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: replicas, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}
