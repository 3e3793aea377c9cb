package main

import (
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/examplesvc/exampletest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the example on its own cluster, broker and Connect worker
// (or on the services the environment names) and checks its summary.
func TestRun(t *testing.T) {
	stdout, stderr := exampletest.Run(t, run, "-transactions", "200")
	require.Regexp(t, regexp.MustCompile(`^changes=\d+ stale=0 lost=0 order_violations=0\n$`), stdout, "stderr:\n%s", stderr)
	require.Contains(t, stderr, "commit-safe checks on replicas", "stderr:\n%s", stderr)
}

func TestBadFlags(t *testing.T) {
	exampletest.BadFlags(t, run, []string{"-transactions", "0"}, []string{"-nonsense"})
}
