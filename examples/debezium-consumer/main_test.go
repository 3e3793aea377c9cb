package main

import (
	"bytes"
	"context"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the example on its own cluster, broker and Connect worker
// (or on the services the environment names) and checks its summary.
func TestRun(t *testing.T) {
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), []string{"-transactions", "200"}, &stdout, &stderr)
	require.NoError(t, err, "stderr:\n%s", stderr.String())
	require.Regexp(t, regexp.MustCompile(`^changes=\d+ stale=0 lost=0 order_violations=0\n$`), stdout.String(), "stderr:\n%s", stderr.String())
	require.Contains(t, stderr.String(), "commit-safe checks on replicas", "stderr:\n%s", stderr.String())
	t.Logf("stdout: %sstderr:\n%s", stdout.String(), stderr.String())
}

func TestBadFlags(t *testing.T) {
	var stdout, stderr bytes.Buffer
	require.Error(t, run(context.Background(), []string{"-transactions", "0"}, &stdout, &stderr))
	require.Empty(t, stdout.String())
}
