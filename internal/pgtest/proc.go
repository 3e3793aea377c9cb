package pgtest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// installHint ends every "could not run PostgreSQL" error so that whoever
// reads a CI log knows where to look next.
const installHint = "is postgresql-15 installed? see .ci/run"

var (
	binOnce sync.Once
	binDir  string
	binErr  error
)

// pgBinDir finds the PostgreSQL server binaries once per process.
func pgBinDir() (string, error) {
	binOnce.Do(func() {
		var tried []string
		try := func(dir string) bool {
			if dir == "" {
				return false
			}
			tried = append(tried, dir)
			for _, prog := range []string{"postgres", "initdb", "pg_basebackup"} {
				if fi, err := os.Stat(filepath.Join(dir, prog)); err != nil || fi.IsDir() {
					return false
				}
			}
			binDir = dir
			return true
		}
		if try(os.Getenv("PG_BINDIR")) {
			return
		}
		if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
			if try(strings.TrimSpace(string(out))) {
				return
			}
		}
		dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
		// Newest major version first; numeric, so 9.6 does not beat 15.
		sort.Slice(dirs, func(i, j int) bool { return pgMajor(dirs[i]) > pgMajor(dirs[j]) })
		for _, d := range dirs {
			if try(d) {
				return
			}
		}
		binErr = fmt.Errorf("pgtest: PostgreSQL server binaries not found (tried $PG_BINDIR, pg_config --bindir, /usr/lib/postgresql/*/bin: %v); %s", tried, installHint)
	})
	return binDir, binErr
}

func pgMajor(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

var (
	credOnce sync.Once
	cred     *syscall.Credential
	credErr  error
)

// serviceCredential is the identity PostgreSQL programs run as: nil (our own)
// unless we are root, which postgres refuses.
func serviceCredential() (*syscall.Credential, error) {
	credOnce.Do(func() {
		if os.Geteuid() != 0 {
			return
		}
		name := os.Getenv("PGTEST_USER")
		if name == "" {
			name = "nobody"
		}
		u, err := user.Lookup(name)
		if err != nil {
			credErr = fmt.Errorf("pgtest: running as root, so PostgreSQL must run as an unprivileged user, but user %q was not found: %w (set PGTEST_USER)", name, err)
			return
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil || uid == 0 {
			credErr = fmt.Errorf("pgtest: user %q (uid %s gid %s) cannot run PostgreSQL (set PGTEST_USER)", name, u.Uid, u.Gid)
			return
		}
		// Empty Groups with NoSetGroups=false drops root's supplementary groups.
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
	})
	return cred, credErr
}

// chownService hands a path we created to the service user.
func chownService(path string) error {
	c, err := serviceCredential()
	if err != nil || c == nil {
		return err
	}
	return os.Chown(path, int(c.Uid), int(c.Gid))
}

// mkdirService creates a 0700 directory owned by the service user.
func mkdirService(path string) error {
	if err := os.Mkdir(path, 0o700); err != nil {
		return err
	}
	return chownService(path)
}

// writeServiceFile writes a file PostgreSQL must be able to read or remove.
func writeServiceFile(path string, data []byte) error {
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return err
	}
	return chownService(path)
}

// serviceEnv is a clean environment: inherited PGHOST/PGPORT/PGDATA or a
// locale the server does not know would change what the programs do.
func serviceEnv(home string) []string {
	path := os.Getenv("PATH")
	if path == "" {
		path = "/usr/local/bin:/usr/bin:/bin"
	}
	env := []string{"PATH=" + path, "HOME=" + home, "LC_ALL=C", "LANG=C"}
	if tz, ok := os.LookupEnv("TZ"); ok {
		env = append(env, "TZ="+tz)
	}
	return env
}

// serviceCmd prepares a PostgreSQL program. Setpgid keeps a terminal's
// Ctrl-C (sent to the foreground process group) away from the servers, so the
// test binary's own handler decides the order of shutdown.
func serviceCmd(dir string, prog string, args ...string) (*exec.Cmd, error) {
	bin, err := pgBinDir()
	if err != nil {
		return nil, err
	}
	c, err := serviceCredential()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(bin, prog), args...)
	cmd.Dir = dir
	cmd.Env = serviceEnv(dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: c}
	return cmd, nil
}

// runService runs a short-lived PostgreSQL program to completion and returns
// its combined output; ctx cancellation kills it.
func runService(ctx context.Context, dir, prog string, args ...string) ([]byte, error) {
	cmd, err := serviceCmd(dir, prog, args...)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		err = ctx.Err()
	}
	return out.Bytes(), err
}

// process is a long-running child whose exit we observe exactly once.
type process struct {
	cmd  *exec.Cmd
	pid  int
	done chan struct{}
	err  error // valid after done is closed
}

func spawn(cmd *exec.Cmd) (*process, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &process{cmd: cmd, pid: cmd.Process.Pid, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

func (p *process) exited() bool {
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

// wait waits for exit up to d; false on timeout.
func (p *process) wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.done:
		return true
	case <-t.C:
		return false
	}
}

// alive reports whether pid is a live (non-zombie) process. A zombie counts
// as dead: orphans are reaped by whatever PID 1 is, which may be slow.
func alive(pid int) bool {
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

// childrenOf lists the direct children of pid by scanning /proc, which
// works without CONFIG_PROC_CHILDREN.
func childrenOf(pid int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var kids []int
	for _, e := range ents {
		cpid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
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

// killTree SIGKILLs a postmaster and its children. Postmaster children call
// setsid(), so a process-group kill would miss them; stopping the
// postmaster first keeps it from forking new ones while we enumerate.
func killTree(p *process) {
	if p.exited() {
		return
	}
	_ = syscall.Kill(p.pid, syscall.SIGSTOP)
	kids := childrenOf(p.pid)
	_ = syscall.Kill(p.pid, syscall.SIGKILL)
	for _, k := range kids {
		_ = syscall.Kill(k, syscall.SIGKILL)
	}
	p.wait(10 * time.Second)
	deadline := time.Now().Add(5 * time.Second)
	for _, k := range kids {
		for alive(k) && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// logTail returns the last lines of a log written since offset, for errors.
func logTail(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	defer func() { _ = f.Close() }()
	const max = 4096
	if fi, err := f.Stat(); err == nil && fi.Size()-offset > max {
		offset = fi.Size() - max
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return ""
	}
	b, _ := io.ReadAll(f)
	return tailLines(string(b), 15)
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// sleepCtx sleeps d or until ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// withDefaultTimeout bounds waits that callers start without a deadline, so
// a wedged replica fails a test with a message instead of hanging it.
func withDefaultTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d)
}
