package testsvc_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// ProcessesIn finds a child by its working directory, below one of the
// dirs too, and stops finding it once it has exited.
func TestProcessesIn(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	sub := filepath.Join(dir, "sub")
	require.NoError(t, os.Mkdir(sub, 0o700))
	cmd := exec.Command("sleep", "600")
	cmd.Dir = sub
	p, err := testsvc.Spawn(cmd)
	require.NoError(t, err)
	t.Cleanup(func() { _ = syscall.Kill(p.PID(), syscall.SIGKILL); <-p.Done() })

	require.Equal(t, []int{p.PID()}, testsvc.ProcessesIn([]string{t.TempDir(), dir}))
	require.Empty(t, testsvc.ProcessesIn([]string{dir + "-not"}), "a sibling whose name starts the same is not inside")

	require.NoError(t, syscall.Kill(p.PID(), syscall.SIGKILL))
	require.True(t, p.Wait(time.Minute))
	require.Empty(t, testsvc.ProcessesIn([]string{dir}))
}
