package proxytest_test

import (
	"context"
	"fmt"
	"os"
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
	return testsvc.RunHelper(mode, func(ctx context.Context) ([]string, error) {
		// Neither connects to a backend before a client asks, so none is needed.
		h, err := proxytest.NewHAProxy(ctx, proxytest.HAProxyConfig{Backends: []string{"127.0.0.1:1", "127.0.0.1:2"}})
		if err != nil {
			return nil, err
		}
		b, err := proxytest.NewPgBouncer(ctx, proxytest.PgBouncerConfig{Backends: []string{"127.0.0.1:1", "127.0.0.1:2"}})
		if err != nil {
			return nil, err
		}
		return []string{h.Dir(), b.Dir()}, nil
	})
}

// However the test binary dies, its haproxy and pgbouncer die with it and
// their directories go.
func TestCleanupWhenTestBinaryDies(t *testing.T) {
	testsvc.RequireCleanupWhenHelperDies(t, helperEnv, 30*time.Second, func(t *testing.T, h *testsvc.HelperBinary) {
		require.Len(t, h.Dirs, 2, "haproxy's and pgbouncer's; stderr:\n%s", h.Stderr())
		before := testsvc.ProcessesIn(h.Dirs)
		require.Len(t, before, 2, "haproxy and pgbouncer in %v", h.Dirs)
		require.Len(t, services(helperPID(t, before)), 2, "both are the helper's children, named haproxy and pgbouncer")
	})
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
