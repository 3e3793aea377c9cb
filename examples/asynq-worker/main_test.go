package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the program on its own services, with replay paused at
// random, and checks the summary line, and that no task ran after a failed
// attempt: caughtupasynq.NewServer keeps deferrals from counting as one.
func TestRun(t *testing.T) {
	t.Setenv("CAUGHTUP_PRIMARY_URL", "")
	t.Setenv("REDIS_ADDR", "")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	err := run(ctx, []string{"-tasks", "200", "-max-pause", "1500ms"}, &stdout, &stderr)
	t.Log(strings.TrimSpace(stderr.String()))
	require.NoError(t, err)
	require.Equal(t, "tasks=200 stale=0 lost=0\n", stdout.String())
	require.Contains(t, stderr.String(), " retried=0")
}

func TestBadFlags(t *testing.T) {
	var stdout, stderr bytes.Buffer
	require.Error(t, run(context.Background(), []string{"-tasks", "0"}, &stdout, &stderr))
	require.Error(t, run(context.Background(), []string{"-nonsense"}, &stdout, &stderr))
	require.Empty(t, stdout.String())
}
