package testsvc_test

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

const helperEnv = "TESTSVC_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helperMain())
	}
	os.Exit(m.Run())
}

// helperMain starts a process in a sandbox, reports the sandbox and waits
// to be killed.
func helperMain() int {
	sb, err := testsvc.NewSandbox("testsvc-helper-", false)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	cmd := exec.Command("sleep", "3600")
	cmd.Dir = sb.Root()
	if _, err := testsvc.Spawn(cmd); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	fmt.Printf("READY %s\n", sb.Root())
	time.Sleep(time.Hour)
	return 0
}

// A SIGKILLed test binary leaves nothing behind in its sandbox: the
// watchdog kills the process there and removes the directory.
func TestHelperBinaryKilled(t *testing.T) {
	t.Parallel()
	h := testsvc.StartHelperBinary(t, helperEnv, "kill", time.Minute)
	require.Len(t, h.Dirs, 1)
	require.Len(t, testsvc.ProcessesIn(h.Dirs), 1, "the sleep in %v", h.Dirs)
	require.NoError(t, h.Signal(syscall.SIGKILL))
	require.Error(t, h.Wait())
	h.RequireGone(t, 20*time.Second)
}
