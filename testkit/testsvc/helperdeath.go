package testsvc

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// HelperModes are the ways of dying that the harnesses' cleanup tests put
// a HelperBinary through: "kill" (SIGKILL: only the watchdogs are left),
// "term" (SIGTERM: the signal handler closes what is registered) and
// "panic" (what go test -timeout does: no deferred cleanup).
var HelperModes = []string{"kill", "term", "panic"}

// RunHelper is TestMain's part of a HelperBinary started in mode: start
// starts the services and returns their directories; RunHelper reports
// them after READY, waits for a line on stdin, then panics in mode "panic"
// and otherwise sleeps until the signal comes. It returns the exit status,
// 3 (with start's error on stderr) when start failed. start's context
// ends after a minute.
func RunHelper(mode string, start func(ctx context.Context) (dirs []string, err error)) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dirs, err := start(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	fmt.Printf("READY %s\n", strings.Join(dirs, " "))
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	if mode == "panic" {
		panic("cleanup helper: simulated test panic")
	}
	time.Sleep(time.Hour)
	return 0
}

// Die makes the helper die the way mode (one of HelperModes) says.
func (h *HelperBinary) Die(mode string) error {
	switch mode {
	case "kill":
		return h.Signal(syscall.SIGKILL)
	case "term":
		return h.Signal(syscall.SIGTERM)
	case "panic":
		return h.Tell("go")
	}
	return fmt.Errorf("testsvc: no helper mode %q", mode)
}

// RequireCleanupWhenHelperDies is a harness's cleanup test: for each of
// HelperModes, in a parallel subtest, it starts the helper (env=mode,
// waiting up to ready for its READY line), lets check look at what it
// started, makes it die that way and requires that it failed and that no
// process runs in its directories, and none of them exists, 10s later.
func RequireCleanupWhenHelperDies(t *testing.T, env string, ready time.Duration, check func(t *testing.T, h *HelperBinary)) {
	t.Helper()
	for _, mode := range HelperModes {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			h := StartHelperBinary(t, env, mode, ready)
			check(t, h)
			began := time.Now()
			require.NoError(t, h.Die(mode))
			err := h.Wait()
			t.Logf("helper exited: %v", err)
			require.Error(t, err)
			h.RequireGone(t, 10*time.Second)
			t.Logf("everything gone %v after the helper died", time.Since(began).Round(time.Millisecond))
		})
	}
}
