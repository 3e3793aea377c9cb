package testsvc

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// FindBinary finds a program: the path in the environment variable env if
// set (so that a machine with several versions can choose; it is not
// checked), else name on $PATH, else the first of also that exists.
func FindBinary(env, name string, also ...string) (string, bool) {
	if b := os.Getenv(env); b != "" {
		return b, true
	}
	if b, err := exec.LookPath(name); err == nil {
		return b, true
	}
	for _, b := range also {
		if _, err := os.Stat(b); err == nil {
			return b, true
		}
	}
	return "", false
}

// Process is a long-running child whose exit is observed exactly once.
type Process struct {
	cmd  *exec.Cmd
	pid  int
	done chan struct{}
	err  error // valid after done is closed
}

// Spawn starts cmd and reaps it in the background.
func Spawn(cmd *exec.Cmd) (*Process, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Process{cmd: cmd, pid: cmd.Process.Pid, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// PID is the child's process id.
func (p *Process) PID() int { return p.pid }

// Done is closed when the child has exited and been reaped.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is how the child exited (exec.Cmd.Wait's error); nil while it runs.
func (p *Process) Err() error {
	if !p.Exited() {
		return nil
	}
	return p.err
}

// Exited reports whether the child has exited; a nil Process has.
func (p *Process) Exited() bool {
	if p == nil {
		return true
	}
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Wait waits for exit up to d; false on timeout.
func (p *Process) Wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.done:
		return true
	case <-t.C:
		return false
	}
}

// Alive reports whether pid is a live (non-zombie) process. A zombie counts
// as dead: orphans are reaped by whatever PID 1 is, which may be slow.
func Alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return syscall.Kill(pid, 0) == nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return true
	}
	return b[i+2] != 'Z' && b[i+2] != 'X'
}

// allPIDs lists the processes in /proc.
func allPIDs() []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	pids := make([]int, 0, len(ents))
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// ChildrenOf lists the direct children of pid by scanning /proc, which
// works without CONFIG_PROC_CHILDREN.
func ChildrenOf(pid int) []int {
	var kids []int
	for _, cpid := range allPIDs() {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(cpid) + "/stat")
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			kids = append(kids, cpid)
		}
	}
	return kids
}

// ProcessesIn lists the live processes whose working directory is one of
// dirs or inside it: the rule a Sandbox's watchdog kills by, for tests that
// check it left nothing behind.
func ProcessesIn(dirs []string) []int {
	var pids []int
	for _, pid := range allPIDs() {
		cwd, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/cwd")
		if err != nil {
			continue
		}
		cwd = strings.TrimSuffix(cwd, " (deleted)")
		for _, d := range dirs {
			if (cwd == d || strings.HasPrefix(cwd, d+"/")) && Alive(pid) {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// LogTail returns the last lines of a log written since offset, for errors.
func LogTail(path string, offset int64) string {
	return LogTailN(path, offset, 15)
}

// LogTailN is LogTail with n lines (at most the last 16 KiB).
func LogTailN(path string, offset int64, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	defer func() { _ = f.Close() }()
	max := int64(4096)
	if n > 15 {
		max = 16384
	}
	if fi, err := f.Stat(); err == nil && fi.Size()-offset > max {
		offset = fi.Size() - max
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return ""
	}
	b, _ := io.ReadAll(f)
	return TailLines(string(b), n)
}

// TailLines returns the last n lines of s.
func TailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// FileSize is path's size, 0 if it does not exist; log offsets start here.
func FileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// SleepCtx sleeps d or until ctx is done.
func SleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// WithDefaultTimeout bounds waits that callers start without a deadline, so
// a wedged service fails a test with a message instead of hanging it.
func WithDefaultTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d)
}
