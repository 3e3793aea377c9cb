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
// random, and checks the summary line: no session ever missed its own
// note. Where the reads went varies with the pauses and is only logged.
func TestRun(t *testing.T) {
	c := exampletest.Start(t, examplesvc.Options{})
	stdout, stderr := exampletest.Run(t, c, 1500*time.Millisecond, run, exampletest.Env(t, c), "-sessions", "60")
	require.Equal(t, "sessions=60 writes=180 stale=0\n", stdout)
	require.Contains(t, stderr, "own writes read: replica=")
}

func TestBadFlags(t *testing.T) {
	exampletest.BadFlags(t, run, []string{"-sessions", "0"}, []string{"-writes", "-1"}, []string{"-nonsense"})
}

func TestMissingEnv(t *testing.T) {
	exampletest.MissingEnv(t, run, map[string]string{
		"CAUGHTUP_PRIMARY_URL":  "postgres://localhost/x",
		"CAUGHTUP_REPLICA_URLS": "postgres://localhost/x",
	})
}
