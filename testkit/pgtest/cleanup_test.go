package pgtest_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// helperEnv makes the test binary act as a "test binary that dies": it
// starts a cluster (with a replica in mode kill) and a redis-server,
// reports where they live, then waits to be killed or told to panic.
const helperEnv = "PGTEST_CLEANUP_HELPER"

func helperMain(mode string) int {
	return testsvc.RunHelper(mode, func(ctx context.Context) ([]string, error) {
		replicas := -1
		if mode == "kill" {
			replicas = 1
		}
		c, err := pgtest.Start(ctx, pgtest.Options{Replicas: replicas})
		if err != nil {
			return nil, err
		}
		r, err := pgtest.StartRedis(ctx)
		if err != nil {
			return nil, err
		}
		v, err := pgtest.ServerVersion(ctx)
		if err != nil {
			return nil, err
		}
		dirs := []string{c.Dir(), r.Dir()}
		if v.Temporary {
			// The copy of the binaries must go with the process too.
			dirs = append(dirs, filepath.Dir(v.Bin))
		}
		return dirs, nil
	})
}

func TestCleanupWhenTestBinaryDies(t *testing.T) {
	testsvc.RequireCleanupWhenHelperDies(t, helperEnv, 60*time.Second, func(t *testing.T, h *testsvc.HelperBinary) {
		v, err := pgtest.ServerVersion(context.Background())
		require.NoError(t, err)
		if v.Temporary {
			require.Len(t, h.Dirs, 3, "the cluster's, redis's and the binaries' copy; stderr:\n%s", h.Stderr())
		} else {
			require.Len(t, h.Dirs, 2, "the cluster's and redis's; stderr:\n%s", h.Stderr())
		}
		before := testsvc.ProcessesIn(h.Dirs)
		// kill: primary + replica postmasters and their children, redis.
		require.GreaterOrEqual(t, len(before), 3, "processes in %v", h.Dirs)
		t.Logf("%d processes in %v", len(before), h.Dirs)
		for _, d := range h.Dirs {
			require.DirExists(t, d)
		}
	})
}
