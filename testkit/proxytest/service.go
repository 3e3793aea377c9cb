package proxytest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// spec is how to run one kind of service.
type spec struct {
	name string // "haproxy", "pgbouncer": names the sandbox, the directory and the log
	bin  string
	// files returns the files to write into the service's directory (name →
	// content) and the program's arguments, for the port it listens on.
	files func(dir string, port int) (map[string]string, []string)
	// ready reports nil once the service serves; it is polled.
	ready func(ctx context.Context, s *service) error
}

// service is one running haproxy or pgbouncer: a foreground process in a
// sandbox of its own, whose watchdog kills it if the test binary dies (it
// matches processes by working directory, and neither program changes
// directory when it runs in the foreground without chroot).
type service struct {
	spec       spec
	sb         *testsvc.Sandbox
	dir        string
	logPath    string
	port       int
	proc       *testsvc.Process
	unregister func()

	mu     sync.Mutex
	closed bool
}

// errPortInUse: the port was taken between PickPort and the bind; pick
// another.
var errPortInUse = errors.New("proxytest: port taken")

func startService(ctx context.Context, sp spec) (*service, error) {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	cred, err := testsvc.ServiceCredential()
	if err != nil {
		return nil, err
	}
	sb, err := testsvc.NewSandbox("proxytest-"+sp.name+"-", cred != nil)
	if err != nil {
		return nil, err
	}
	s := &service{spec: sp, sb: sb, dir: filepath.Join(sb.Root(), sp.name)}
	s.logPath = filepath.Join(s.dir, sp.name+".log")
	s.unregister = testsvc.Register(s.Close)
	if err := mkdirService(s.dir); err != nil {
		_ = s.Close()
		return nil, err
	}
	for range 5 {
		port, fd, perr := testsvc.PickPort()
		if perr != nil {
			err = perr
			break
		}
		if err = s.startOn(ctx, port, &fd, cred); !errors.Is(err, errPortInUse) {
			break
		}
	}
	if err != nil {
		_ = s.Close()
		return nil, err
	}
	return s, nil
}

func (s *service) startOn(ctx context.Context, port int, hold *int, cred *syscall.Credential) error {
	defer testsvc.UnholdPort(hold)
	files, args := s.spec.files(s.dir, port)
	for name, content := range files {
		if err := writeServiceFile(filepath.Join(s.dir, name), content); err != nil {
			return err
		}
	}
	offset := testsvc.FileSize(s.logPath)
	lf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("proxytest: %w", err)
	}
	cmd := exec.Command(s.spec.bin, args...)
	cmd.Dir = s.dir
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + s.dir, "LC_ALL=C"}
	cmd.Stdout, cmd.Stderr = lf, lf
	// Own process group: a terminal's Ctrl-C goes to the test binary's
	// handler, which closes services in its own order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: cred}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = lf.Close()
		return errClosed
	}
	testsvc.UnholdPort(hold)
	p, err := testsvc.Spawn(cmd)
	if err == nil {
		s.proc, s.port = p, port
		s.sb.RecordPID(s.spec.name, p.PID())
	}
	s.mu.Unlock()
	_ = lf.Close()
	if err != nil {
		return fmt.Errorf("proxytest: start %s: %w", s.spec.bin, err)
	}
	for {
		if p.Exited() {
			s.sb.ForgetPID(s.spec.name)
			tail := testsvc.LogTail(s.logPath, offset)
			if strings.Contains(tail, "Address already in use") {
				return fmt.Errorf("%w: %s :%d", errPortInUse, s.spec.name, port)
			}
			return fmt.Errorf("proxytest: %s exited during startup (%v); log %s:\n%s", s.spec.name, p.Err(), s.logPath, tail)
		}
		rerr := s.spec.ready(ctx, s)
		if rerr == nil {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 10*time.Millisecond); err != nil {
			s.stop()
			return fmt.Errorf("proxytest: %s on :%d not ready: %v (%w); log %s:\n%s", s.spec.name, port, rerr, err, s.logPath, testsvc.LogTail(s.logPath, offset))
		}
	}
}

// Addr is 127.0.0.1:port, where clients connect.
func (s *service) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Dir is the sandbox Close removes; the service runs in it.
func (s *service) Dir() string { return s.sb.Root() }

// LogPath is the service's log (its stderr), for failure messages.
func (s *service) LogPath() string { return s.logPath }

// Port is the port it listens on, on 127.0.0.1.
func (s *service) Port() int { return s.port }

// PID is the service's process id.
func (s *service) PID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc.PID()
}

// stop ends the process: SIGTERM (both programs exit at once on it),
// SIGKILL if that does not do within 5 s.
func (s *service) stop() {
	s.mu.Lock()
	p := s.proc
	s.mu.Unlock()
	if p.Exited() {
		return
	}
	_ = syscall.Kill(p.PID(), syscall.SIGTERM)
	if !p.Wait(5 * time.Second) {
		_ = syscall.Kill(p.PID(), syscall.SIGKILL)
		p.Wait(5 * time.Second)
	}
	s.sb.ForgetPID(s.spec.name)
}

// Close stops the service and removes its sandbox; idempotent, and safe to
// call from the signal handler while a test uses the service.
func (s *service) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.stop()
	s.mu.Lock()
	p := s.proc
	s.mu.Unlock()
	var err error
	if !p.Exited() {
		err = fmt.Errorf("proxytest: %s (pid %d) did not exit", s.spec.name, p.PID())
	}
	if rerr := s.sb.Remove(); err == nil {
		err = rerr
	}
	s.unregister()
	return err
}

var errClosed = errors.New("proxytest: closed (by Close or by the SIGINT/SIGTERM handler)")

// mkdirService creates a 0700 directory owned by the service user.
func mkdirService(path string) error {
	if err := os.Mkdir(path, 0o700); err != nil {
		return fmt.Errorf("proxytest: %w", err)
	}
	return testsvc.ChownService(path)
}

// writeServiceFile writes a file the service user must be able to read.
func writeServiceFile(path, content string) error {
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		return fmt.Errorf("proxytest: %w", err)
	}
	return testsvc.ChownService(path)
}

// dialable reports whether a TCP connection to addr opens.
func dialable(ctx context.Context, addr string) error {
	d := net.Dialer{Timeout: time.Second}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	return c.Close()
}
