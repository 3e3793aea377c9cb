package testsvc

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// watchdogScript runs detached from the test binary. fd 3 is the read end of
// a pipe whose only writer is the test binary, so read returns EOF exactly
// when the test binary is gone, however it died, with no polling and no PID
// that could be recycled. It then kills everything whose working directory is
// inside $1 (postgres and redis chdir into their data dirs; postmaster
// children inherit it; the JVMs of testkit/kafkatest are started there),
// frees the SysV segments of crashed postmasters and removes $1. The sweep
// repeats because a dying postmaster's children may have just forked.
const watchdogScript = `dir=$1
while read -r _ <&3; do :; done
exec 3<&-
inside() {
	if command -v find >/dev/null 2>&1; then
		find /proc -mindepth 2 -maxdepth 2 -name cwd \( -lname "$dir" -o -lname "$dir/*" -o -lname "$dir (deleted)" \) 2>/dev/null
	else
		for p in /proc/[0-9]*; do
			case "$(readlink $p/cwd 2>/dev/null)" in
			"$dir"|"$dir"/*|"$dir (deleted)") echo "$p/cwd" ;;
			esac
		done
	fi
}
for round in 1 2 3; do
	for f in "$dir"/pids/*.pid; do
		[ -f "$f" ] || continue
		read -r p < "$f" || continue
		case "$(readlink /proc/$p/cwd 2>/dev/null)" in
		"$dir"/*) kill -9 "$p" 2>/dev/null ;;
		esac
	done
	for c in $(inside); do
		p=${c#/proc/}
		kill -9 "${p%/cwd}" 2>/dev/null
	done
	sleep 0.05
done
if command -v ipcrm >/dev/null 2>&1; then
	for f in "$dir"/*/data/postmaster.pid; do
		[ -f "$f" ] || continue
		set -- $(sed -n 7p "$f")
		[ -n "$2" ] && ipcrm -m "$2" 2>/dev/null
	done
fi
for try in 1 2 3 4 5; do
	rm -rf "$dir" 2>/dev/null
	[ -e "$dir" ] || exit 0
	sleep 0.2
done
`

// Sandbox is a temporary directory guarded by a watchdog.
type Sandbox struct {
	root     string
	watchdog *exec.Cmd
	lifeline *os.File // write end; closing it (or dying) triggers the watchdog

	mu     sync.Mutex
	closed bool
}

// TempBase picks where sandboxes live: $PGTEST_TMPDIR, else /dev/shm when it
// is a tmpfs with room, else the usual temp dir. On the CI machines /dev/shm
// makes a PostgreSQL primary + 2 replicas start in about 1.2 s instead of
// 4-5 s, because initdb and pg_basebackup are bound by file creation on the
// root disk; the price is RAM, which the harnesses keep small.
func TempBase() string {
	if d := os.Getenv("PGTEST_TMPDIR"); d != "" {
		return d
	}
	const tmpfsMagic = 0x01021994
	var st syscall.Statfs_t
	if syscall.Statfs("/dev/shm", &st) == nil && st.Type == tmpfsMagic &&
		uint64(st.Bavail)*uint64(st.Bsize) >= 2<<30 && syscall.Access("/dev/shm", 2 /* W_OK */) == nil {
		return "/dev/shm"
	}
	return os.TempDir()
}

// NewSandbox creates a temporary directory under TempBase, named prefix
// followed by random characters, and starts its watchdog. Traversable makes
// the directory mode 0711 and checks that its ancestors let other users
// through too, for services that run as an unprivileged user (PostgreSQL
// when the test binary is root) and must reach their own 0700 directories
// inside it.
func NewSandbox(prefix string, traversable bool) (*Sandbox, error) {
	root, err := os.MkdirTemp(TempBase(), prefix)
	if err != nil {
		return nil, fmt.Errorf("testsvc: cannot create temp dir: %w", err)
	}
	// Resolve symlinks: the watchdog matches /proc/*/cwd, which the kernel
	// reports fully resolved.
	if r, err := filepath.EvalSymlinks(root); err == nil {
		root = r
	}
	fail := func(err error) (*Sandbox, error) {
		_ = os.RemoveAll(root)
		return nil, err
	}
	if traversable {
		if err := os.Chmod(root, 0o711); err != nil {
			return fail(err)
		}
		if err := checkTraversable(filepath.Dir(root)); err != nil {
			return fail(err)
		}
	}
	if err := os.Mkdir(filepath.Join(root, "pids"), 0o700); err != nil {
		return fail(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return fail(err)
	}
	cmd := exec.Command("/bin/sh", "-c", watchdogScript, "testsvc-watchdog", root)
	cmd.Dir = "/" // never inside root, or the sweep would kill the watchdog
	cmd.ExtraFiles = []*os.File{r}
	// A session of its own: a terminal's Ctrl-C, `kill -- -pgid` of the test
	// binary's group or go test's own cleanup must not take it down.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	_ = r.Close()
	if err != nil {
		_ = w.Close()
		return fail(fmt.Errorf("testsvc: cannot start cleanup watchdog (/bin/sh): %w", err))
	}
	return &Sandbox{root: root, watchdog: cmd, lifeline: w}, nil
}

// checkTraversable fails early, with a fix, when the service user could not
// reach its directory through the temp dir's ancestors.
func checkTraversable(dir string) error {
	for d := dir; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		if fi.Mode().Perm()&0o001 == 0 {
			return fmt.Errorf("testsvc: %s is not traversable by other users, so the unprivileged service user cannot reach its data dir; set PGTEST_TMPDIR=/tmp", d)
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}

// Root is the sandbox's directory, symlinks resolved.
func (s *Sandbox) Root() string { return s.root }

// RecordPID gives the watchdog a second path to each server besides the
// working-directory sweep; the script still checks the PID's cwd, so a PID
// recycled after a server exited is never hit.
func (s *Sandbox) RecordPID(name string, pid int) {
	p := filepath.Join(s.root, "pids", name+".pid")
	tmp := p + ".tmp"
	if os.WriteFile(tmp, []byte(strconv.Itoa(pid)+"\n"), 0o600) == nil {
		_ = os.Rename(tmp, p)
	}
}

// ForgetPID undoes RecordPID once the server has exited.
func (s *Sandbox) ForgetPID(name string) {
	_ = os.Remove(filepath.Join(s.root, "pids", name+".pid"))
}

// Remove deletes the directory and retires the watchdog. Call it only after
// every process in the sandbox has exited.
func (s *Sandbox) Remove() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	var err error
	for range 5 {
		if err = os.RemoveAll(s.root); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err == nil {
		_ = syscall.Kill(-s.watchdog.Process.Pid, syscall.SIGKILL)
		_ = s.lifeline.Close()
		_ = s.watchdog.Wait()
		return nil
	}
	// Let the watchdog sweep and retry the removal; it has no reason to fail
	// where we did, but if it does the error below still names the dir.
	_ = s.lifeline.Close()
	done := make(chan struct{})
	go func() { _ = s.watchdog.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
	}
	if _, statErr := os.Stat(s.root); statErr == nil {
		return fmt.Errorf("testsvc: cannot remove %s: %w", s.root, err)
	}
	return nil
}

// The registry of running services, for the signal handler. The handler is
// installed only while something is registered, so a test binary that has
// closed everything is left with its default signal behaviour and no extra
// goroutine.
var registry struct {
	sync.Mutex
	next   int
	live   map[int]func() error
	sigCh  chan os.Signal
	stopCh chan struct{}
}

// Register adds a service's Close to what SIGINT and SIGTERM close before
// the process dies of the signal; call unregister once it is closed. A
// program with its own graceful shutdown gets this too: while a service is
// registered, SIGINT ends the process once the services are closed.
func Register(closer func() error) (unregister func()) {
	registry.Lock()
	defer registry.Unlock()
	if registry.live == nil {
		registry.live = map[int]func() error{}
	}
	id := registry.next
	registry.next++
	registry.live[id] = closer
	if registry.sigCh == nil {
		registry.sigCh = make(chan os.Signal, 1)
		registry.stopCh = make(chan struct{})
		signal.Notify(registry.sigCh, syscall.SIGINT, syscall.SIGTERM)
		go handleSignals(registry.sigCh, registry.stopCh)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			registry.Lock()
			defer registry.Unlock()
			delete(registry.live, id)
			if len(registry.live) == 0 && registry.sigCh != nil {
				signal.Stop(registry.sigCh)
				close(registry.stopCh)
				registry.sigCh, registry.stopCh = nil, nil
			}
		})
	}
}

func handleSignals(ch chan os.Signal, stop chan struct{}) {
	var sig os.Signal
	select {
	case <-stop:
		return
	case sig = <-ch:
	}
	registry.Lock()
	closers := make([]func() error, 0, len(registry.live))
	for _, c := range registry.live {
		closers = append(closers, c)
	}
	registry.Unlock()
	fmt.Fprintf(os.Stderr, "testsvc: %v: stopping %d test service(s)\n", sig, len(closers))
	var wg sync.WaitGroup
	for _, c := range closers {
		wg.Add(1)
		go func() { defer wg.Done(); _ = c() }()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		// The watchdogs finish the job once we are gone.
	}
	// Die of the signal, so the parent sees the usual status.
	signal.Reset(sig)
	if s, ok := sig.(syscall.Signal); ok {
		_ = syscall.Kill(os.Getpid(), s)
		time.Sleep(time.Second)
	}
	os.Exit(1)
}
