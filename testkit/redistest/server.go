package redistest

import (
	"bufio"
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

// errPortInUse marks a start that lost the race for its port; only a fresh
// port helps.
var errPortInUse = errors.New("redistest: port already in use")

// errClosed is returned by operations on a closed harness, e.g. after the
// SIGINT/SIGTERM handler closed it under a running test.
var errClosed = errors.New("redistest: closed (by Close or by the SIGINT/SIGTERM handler)")

func redisBinary() (string, error) {
	if b, ok := testsvc.FindBinary("REDIS_SERVER", "redis-server", "/usr/bin/redis-server"); ok {
		return b, nil
	}
	return "", errors.New("redistest: redis-server not found ($REDIS_SERVER, $PATH, /usr/bin); is redis-server installed? see scripts/install-deps")
}

// Server is one redis-server (a cluster node, a master or replica of a
// Sentinel set) or one Sentinel, in its own directory of the harness's
// sandbox, on a loopback port that survives Kill and Start.
type Server struct {
	name    string
	sb      *testsvc.Sandbox
	bin     string
	dir     string
	logPath string
	args    func(port int) []string // the command line after the binary
	cred    *syscall.Credential     // whom it runs as; nil: as the test binary

	opMu sync.Mutex

	mu     sync.Mutex
	port   int
	hold   int // socket reserving port while the server is down, or -1
	proc   *testsvc.Process
	closed bool
}

func newServer(sb *testsvc.Sandbox, bin, name string, cred *syscall.Credential, args func(port int) []string) (*Server, error) {
	s := &Server{name: name, sb: sb, bin: bin, dir: filepath.Join(sb.Root(), name), args: args, cred: cred, hold: -1}
	s.logPath = filepath.Join(s.dir, "redis.log")
	if err := os.Mkdir(s.dir, 0o700); err != nil {
		return nil, fmt.Errorf("redistest: %w", err)
	}
	if cred != nil {
		if err := os.Chown(s.dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return nil, fmt.Errorf("redistest: %w", err)
		}
	}
	return s, nil
}

// pickPort reserves a port for the server's first start.
func (s *Server) pickPort() error {
	port, fd, err := testsvc.PickPort()
	if err != nil {
		return err
	}
	s.mu.Lock()
	testsvc.UnholdPort(&s.hold)
	s.hold, s.port = fd, port
	s.mu.Unlock()
	return nil
}

// firstStart starts the server on a fresh port, trying another when one
// was taken between picking and binding.
func (s *Server) firstStart(ctx context.Context) error {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	var err error
	for range 5 {
		if err = s.pickPort(); err != nil {
			return err
		}
		if err = s.startOn(ctx, s.Port()); !errors.Is(err, errPortInUse) {
			return err
		}
	}
	return err
}

// Name is the server's name in the harness ("node-1", "master",
// "replica-2", "sentinel-3").
func (s *Server) Name() string { return s.name }

// Addr is 127.0.0.1:port.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port())) }

// Port is the loopback TCP port; it survives Kill and Start.
func (s *Server) Port() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.port
}

// Dir is the server's working directory (its config, nodes.conf, log).
func (s *Server) Dir() string { return s.dir }

// Log is the server's log so far, for failure messages.
func (s *Server) Log() string { return testsvc.LogTailN(s.logPath, 0, 40) }

// Running reports whether the process is alive.
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc != nil && !s.proc.Exited()
}

func (s *Server) current() *testsvc.Process {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc
}

func (s *Server) startOn(ctx context.Context, port int) error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return errClosed
	}
	offset := testsvc.FileSize(s.logPath)
	lf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("redistest: %w", err)
	}
	cmd := exec.Command(s.bin, s.args(port)...)
	cmd.Dir = s.dir // the watchdog kills by working directory
	cmd.Env = serviceEnv(s.dir)
	cmd.Stdout, cmd.Stderr = lf, lf
	// Own process group: a terminal's Ctrl-C goes to our handler, not here.
	// Credential: the unprivileged service user when we are root, as
	// pgtest runs PostgreSQL, unless the harness runs it as us.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
	s.mu.Lock()
	testsvc.UnholdPort(&s.hold)
	s.mu.Unlock()
	p, err := testsvc.Spawn(cmd)
	_ = lf.Close()
	if err != nil {
		return fmt.Errorf("redistest: start %s: %w", s.name, err)
	}
	s.sb.RecordPID(s.name, p.PID())
	s.mu.Lock()
	s.proc, s.port = p, port
	s.mu.Unlock()

	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	for {
		if p.Exited() {
			s.sb.ForgetPID(s.name)
			tail := testsvc.LogTail(s.logPath, offset)
			if strings.Contains(tail, "Address already in use") {
				return fmt.Errorf("%w: %s :%d", errPortInUse, s.name, port)
			}
			s.reserve()
			return fmt.Errorf("redistest: %s exited during startup (%v); log %s:\n%s", s.name, p.Err(), s.logPath, tail)
		}
		if ping(ctx, addr) == nil {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 10*time.Millisecond); err != nil {
			_ = syscall.Kill(p.PID(), syscall.SIGKILL)
			p.Wait(5 * time.Second)
			s.sb.ForgetPID(s.name)
			s.reserve()
			return fmt.Errorf("redistest: %s on %s not answering PING: %w; log %s:\n%s", s.name, addr, err, s.logPath, testsvc.LogTail(s.logPath, offset))
		}
	}
}

// Start restarts a killed or stopped server on the same port, with the
// same configuration. A cluster node keeps its identity (nodes.conf) and
// rejoins; its data is gone (no persistence).
func (s *Server) Start(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if s.Running() {
		return nil
	}
	return s.startOn(ctx, s.Port())
}

// Kill SIGKILLs the server and waits for it: no shutdown, no goodbye to
// its clients or peers, as when a machine dies.
func (s *Server) Kill() error { return s.halt(syscall.SIGKILL) }

// Stop shuts the server down with SIGTERM and waits.
func (s *Server) Stop() error { return s.halt(syscall.SIGTERM) }

func (s *Server) halt(sig syscall.Signal) error {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	p := s.current()
	if p.Exited() {
		return nil
	}
	_ = syscall.Kill(p.PID(), sig)
	if !p.Wait(10 * time.Second) {
		_ = syscall.Kill(p.PID(), syscall.SIGKILL)
		if !p.Wait(5 * time.Second) {
			return fmt.Errorf("redistest: %s (pid %d) did not exit", s.name, p.PID())
		}
	}
	s.sb.ForgetPID(s.name)
	s.reserve()
	return nil
}

// reserve keeps the port while the server is down (see testsvc's ports.go).
func (s *Server) reserve() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed && s.hold < 0 && s.port != 0 {
		s.hold, _ = testsvc.HoldPort(s.port)
	}
}

// close kills the server for good and releases its port; a Start racing
// with it fails with errClosed.
func (s *Server) close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	err := s.Kill()
	s.mu.Lock()
	testsvc.UnholdPort(&s.hold)
	s.mu.Unlock()
	return err
}

// ping speaks just enough RESP to tell "accepting commands" from "port
// open".
func ping(ctx context.Context, addr string) error {
	_, err := command(ctx, addr, "PING")
	return err
}

// command sends one inline command and returns the first line of the
// reply; the harness's own needs (PING, CLUSTER INFO's state) are small
// enough not to need a client library.
func command(ctx context.Context, addr string, cmd string) (string, error) {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	conn, err := d.DialContext(dctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(time.Second))
	if _, err := conn.Write([]byte(cmd + "\r\n")); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimSpace(line)
	if strings.HasPrefix(line, "-") {
		return "", fmt.Errorf("redistest: %s answered %q", addr, line)
	}
	return line, nil
}

// serviceEnv is a clean environment for the servers.
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

// newSandbox makes the harness's temporary directory, traversable by the
// service user when we are root.
func newSandbox(prefix string) (*testsvc.Sandbox, error) {
	c, err := testsvc.ServiceCredential()
	if err != nil {
		return nil, err
	}
	return testsvc.NewSandbox(prefix, c != nil)
}

// baseArgs are every server's: loopback only, no persistence, logs to
// stdout (the log file), and a replica's full sync starts at once rather
// than after the default 5s wait for more replicas.
func baseArgs(port int) []string {
	return []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--daemonize", "no",
		"--repl-diskless-sync-delay", "0",
		"--logfile", "", "--loglevel", "notice", "--protected-mode", "no"}
}
