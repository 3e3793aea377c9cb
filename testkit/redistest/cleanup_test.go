package redistest_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/redistest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// helperEnv makes the test binary act as a "test binary that dies": it
// starts a Cluster and a Sentinel set, reports where they live, then
// waits to be killed or told to panic.
const helperEnv = "REDISTEST_CLEANUP_HELPER"

func helperMain(mode string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := redistest.StartCluster(ctx, redistest.ClusterOptions{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	s, err := redistest.StartSentinel(ctx, redistest.SentinelOptions{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	fmt.Printf("READY %s %s\n", c.Dir(), s.Dir())
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	if mode == "panic" {
		panic("redistest cleanup helper: simulated test panic")
	}
	time.Sleep(time.Hour)
	return 0
}

// TestCleanupWhenTestBinaryDies: however the test binary dies (SIGKILL,
// SIGTERM, a panic such as go test -timeout's), no Redis process and no
// directory of the harness survives it.
func TestCleanupWhenTestBinaryDies(t *testing.T) {
	for _, mode := range []string{"kill", "term", "panic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			h := testsvc.StartHelperBinary(t, helperEnv, mode, 60*time.Second)
			require.Len(t, h.Dirs, 2, "the cluster's and the sentinel set's; stderr:\n%s", h.Stderr())
			before := testsvc.ProcessesIn(h.Dirs)
			require.Len(t, before, 6+3+3, "6 cluster nodes, a master, 2 replicas, 3 sentinels in %v", h.Dirs)
			switch mode {
			case "kill":
				require.NoError(t, h.Signal(syscall.SIGKILL))
			case "term":
				require.NoError(t, h.Signal(syscall.SIGTERM))
			case "panic":
				require.NoError(t, h.Tell("go"))
			}
			require.Error(t, h.Wait())
			h.RequireGone(t, 10*time.Second)
		})
	}
}
