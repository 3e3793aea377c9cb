package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/examplesvc"
	"github.com/caughtup/caughtup/testkit/examplesvc/exampletest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the program on the demo's cluster, with replay paused at
// random, and checks the summary line, and that no job ran after a failed
// attempt: the middleware's snoozes do not count as one.
func TestRun(t *testing.T) {
	c := exampletest.Start(t, examplesvc.Options{})
	stdout, stderr := exampletest.Run(t, c, 1500*time.Millisecond, run, exampletest.Env(t, c), "-jobs", "200")
	require.Equal(t, "jobs=200 stale=0 lost=0\n", stdout)
	require.Contains(t, stderr, " retried=0")
}

func TestBadFlags(t *testing.T) {
	exampletest.BadFlags(t, run, []string{"-jobs", "0"}, []string{"-nonsense"})
}

func TestMissingEnv(t *testing.T) {
	exampletest.MissingEnv(t, run, map[string]string{
		"CAUGHTUP_PRIMARY_URL":  "postgres://localhost/x",
		"CAUGHTUP_REPLICA_URLS": "postgres://localhost/x",
	})
}
