package proxytest_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/proxytest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// helperEnv makes the test binary act as a "test binary that dies": it
// starts an haproxy and a pgbouncer, reports where they live, then waits
// to be killed or told to panic.
const helperEnv = "PROXYTEST_CLEANUP_HELPER"

func helperMain(mode string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Neither connects to a backend before a client asks, so none is needed.
	h, err := proxytest.NewHAProxy(ctx, proxytest.HAProxyConfig{Backends: []string{"127.0.0.1:1", "127.0.0.1:2"}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	b, err := proxytest.NewPgBouncer(ctx, proxytest.PgBouncerConfig{Backends: []string{"127.0.0.1:1", "127.0.0.1:2"}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	fmt.Printf("READY %s %s\n", h.Dir(), b.Dir())
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	if mode == "panic" {
		// What `go test -timeout` does: panic, no deferred cleanup.
		panic("proxytest cleanup helper: simulated test panic")
	}
	time.Sleep(time.Hour)
	return 0
}

// However the test binary dies, its haproxy and pgbouncer die with it and
// their directories go.
func TestCleanupWhenTestBinaryDies(t *testing.T) {
	for _, mode := range []string{"kill", "term", "panic"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			h := testsvc.StartHelperBinary(t, helperEnv, mode, 30*time.Second)
			require.Len(t, h.Dirs, 2, "haproxy's and pgbouncer's; stderr:\n%s", h.Stderr())
			before := testsvc.ProcessesIn(h.Dirs)
			require.Len(t, before, 2, "haproxy and pgbouncer in %v", h.Dirs)
			require.Len(t, services(helperPID(t, before)), 2, "both are the helper's children, named haproxy and pgbouncer")

			began := time.Now()
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
			t.Logf("everything gone %v after the helper died", time.Since(began).Round(time.Millisecond))
		})
	}
}

// helperPID is the parent of the processes in the helper's sandboxes.
func helperPID(t *testing.T, pids []int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pids[0]))
	require.NoError(t, err)
	var pid, ppid int
	var comm, state string
	_, err = fmt.Sscanf(string(b), "%d %s %s %d", &pid, &comm, &state, &ppid)
	require.NoError(t, err)
	return ppid
}
