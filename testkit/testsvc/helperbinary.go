package testsvc

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// HelperBinary is the test binary run again as a "test binary that dies":
// in TestMain, the environment variable it is started with makes it start
// services, print "READY" and their directories on one line of stdout, and
// wait to be killed, told to panic on stdin, or the like. The harnesses'
// cleanup tests use it to check that whatever way a test binary dies, the
// watchdogs leave no process and no directory behind.
type HelperBinary struct {
	// Dirs are the directories the helper reported after READY.
	Dirs []string

	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr lockedBuffer
	waited bool
}

// StartHelperBinary runs this test binary, with no tests and env=mode in
// its environment, and waits up to within for its READY line. It fails t if
// the line does not come. The helper is killed when t ends, unless Wait
// has seen it exit.
func StartHelperBinary(t testing.TB, env, mode string, within time.Duration) *HelperBinary {
	t.Helper()
	h := &HelperBinary{cmd: exec.Command(os.Args[0], "-test.run=^$")}
	h.cmd.Env = append(os.Environ(), env+"="+mode)
	stdin, err := h.cmd.StdinPipe()
	require.NoError(t, err)
	h.stdin = stdin
	out, w, err := os.Pipe()
	require.NoError(t, err)
	h.cmd.Stdout = w
	h.cmd.Stderr = &h.stderr
	require.NoError(t, h.cmd.Start())
	_ = w.Close()
	t.Cleanup(func() {
		if !h.waited {
			_ = h.cmd.Process.Kill()
			_ = h.cmd.Wait()
		}
		_ = out.Close()
	})

	lines := make(chan string, 1)
	go func() {
		br := bufio.NewReader(out)
		line, _ := br.ReadString('\n')
		lines <- line
		_, _ = io.Copy(io.Discard, br)
	}()
	var line string
	select {
	case line = <-lines:
	case <-time.After(within):
		t.Fatalf("helper did not report READY within %v; stderr:\n%s", within, h.Stderr())
	}
	fields := strings.Fields(line)
	require.True(t, len(fields) > 1 && fields[0] == "READY", "helper said %q; stderr:\n%s", line, h.Stderr())
	h.Dirs = fields[1:]
	return h
}

// Signal sends sig to the helper.
func (h *HelperBinary) Signal(sig os.Signal) error { return h.cmd.Process.Signal(sig) }

// Tell writes line and a newline to the helper's stdin.
func (h *HelperBinary) Tell(line string) error {
	_, err := io.WriteString(h.stdin, line+"\n")
	return err
}

// Wait waits for the helper to exit and returns how it did.
func (h *HelperBinary) Wait() error {
	err := h.cmd.Wait()
	h.waited = true
	return err
}

// Stderr is what the helper wrote to stderr so far.
func (h *HelperBinary) Stderr() string { return h.stderr.String() }

// RequireGone fails t unless, within d, no process runs in the helper's
// directories and none of them exists any more.
func (h *HelperBinary) RequireGone(t testing.TB, within time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool {
		if len(ProcessesIn(h.Dirs)) > 0 {
			return false
		}
		for _, d := range h.Dirs {
			if _, err := os.Stat(d); !os.IsNotExist(err) {
				return false
			}
		}
		return true
	}, within, 20*time.Millisecond, "left behind: processes %v in %v; helper stderr:\n%s", ProcessesIn(h.Dirs), h.Dirs, h.Stderr())
}

// lockedBuffer collects the helper's stderr, which os/exec copies from
// another goroutine while failure messages read it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
