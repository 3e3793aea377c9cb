package redistest_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/redistest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// helperEnv makes the test binary act as a "test binary that dies": it
// starts a Cluster, a Sentinel set and a Standalone, reports where they
// live, then waits to be killed or told to panic.
const helperEnv = "REDISTEST_CLEANUP_HELPER"

func helperMain(mode string) int {
	return testsvc.RunHelper(mode, func(ctx context.Context) ([]string, error) {
		c, err := redistest.StartCluster(ctx, redistest.ClusterOptions{})
		if err != nil {
			return nil, err
		}
		s, err := redistest.StartSentinel(ctx, redistest.SentinelOptions{})
		if err != nil {
			return nil, err
		}
		r, err := redistest.StartStandalone(ctx, redistest.StandaloneOptions{})
		if err != nil {
			return nil, err
		}
		return []string{c.Dir(), s.Dir(), r.Dir()}, nil
	})
}

// TestCleanupWhenTestBinaryDies: however the test binary dies (SIGKILL,
// SIGTERM, a panic such as go test -timeout's), no Redis process and no
// directory of the harness survives it.
func TestCleanupWhenTestBinaryDies(t *testing.T) {
	testsvc.RequireCleanupWhenHelperDies(t, helperEnv, 60*time.Second, func(t *testing.T, h *testsvc.HelperBinary) {
		require.Len(t, h.Dirs, 3, "the cluster's, the sentinel set's and the standalone's; stderr:\n%s", h.Stderr())
		require.Len(t, testsvc.ProcessesIn(h.Dirs), 6+3+3+1, "6 cluster nodes, a master, 2 replicas, 3 sentinels, a standalone in %v", h.Dirs)
	})
}
