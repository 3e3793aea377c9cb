package pgtest_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// helperEnv makes the test binary act as a "test binary that dies": it starts
// services, reports where they live, then waits to be killed or told to panic.
const helperEnv = "PGTEST_CLEANUP_HELPER"

func helperMain(mode string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	replicas := -1
	if mode == "kill" {
		replicas = 1
	}
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: replicas})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	r, err := pgtest.StartRedis(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	v, err := pgtest.ServerVersion(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	dirs := c.Dir() + " " + r.Dir()
	if v.Temporary {
		// The copy of the binaries must go with the process too.
		dirs += " " + filepath.Dir(v.Bin)
	}
	fmt.Printf("READY %s\n", dirs)
	// Block until the parent says "go" (or forever, for signals).
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	if mode == "panic" {
		// What `go test -timeout` does: panic, no deferred cleanup.
		panic("pgtest cleanup helper: simulated test panic")
	}
	time.Sleep(time.Hour)
	return 0
}

func TestCleanupWhenTestBinaryDies(t *testing.T) {
	for _, mode := range []string{"kill", "term", "panic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			h := testsvc.StartHelperBinary(t, helperEnv, mode, 60*time.Second)
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
			for _, d := range h.Dirs {
				require.DirExists(t, d)
			}

			began := time.Now()
			switch mode {
			case "kill":
				require.NoError(t, h.Signal(syscall.SIGKILL))
			case "term":
				require.NoError(t, h.Signal(syscall.SIGTERM))
			case "panic":
				require.NoError(t, h.Tell("go"))
			}
			waitErr := h.Wait()
			t.Logf("helper (%d processes in %v) exited: %v", len(before), h.Dirs, waitErr)
			require.Error(t, waitErr)

			h.RequireGone(t, 10*time.Second)
			t.Logf("everything gone %v after the helper died", time.Since(began).Round(time.Millisecond))
		})
	}
}
