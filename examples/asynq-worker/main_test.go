package main

import (
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/examplesvc/exampletest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the program on its own services, with replay paused at
// random, and checks the summary line, and that no task ran after a failed
// attempt: caughtupasynq.NewServer keeps deferrals from counting as one.
func TestRun(t *testing.T) {
	t.Setenv("CAUGHTUP_PRIMARY_URL", "")
	t.Setenv("REDIS_ADDR", "")
	stdout, stderr := exampletest.Run(t, run, "-tasks", "200", "-max-pause", "1500ms")
	require.Equal(t, "tasks=200 stale=0 lost=0\n", stdout)
	require.Contains(t, stderr, " retried=0")
}

func TestBadFlags(t *testing.T) {
	exampletest.BadFlags(t, run, []string{"-tasks", "0"}, []string{"-nonsense"})
}
