package pgtest

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

// Redis is a throwaway redis-server without persistence.
type Redis struct {
	sb         *testsvc.Sandbox
	bin        string
	dir        string
	logPath    string
	unregister func()

	opMu sync.Mutex

	mu     sync.Mutex
	port   int
	hold   int // socket reserving port while the server is down, or -1
	proc   *testsvc.Process
	closed bool
}

func redisBinary() (string, error) {
	if b, ok := testsvc.FindBinary("REDIS_SERVER", "redis-server", "/usr/bin/redis-server"); ok {
		return b, nil
	}
	return "", errors.New("pgtest: redis-server not found ($REDIS_SERVER, $PATH, /usr/bin); is redis-server installed? see .ci/run")
}

// StartRedis starts redis-server on a free loopback port.
func StartRedis(ctx context.Context) (*Redis, error) {
	bin, err := redisBinary()
	if err != nil {
		return nil, err
	}
	sb, err := newSandbox("pgtest-redis-")
	if err != nil {
		return nil, err
	}
	r := &Redis{sb: sb, bin: bin, dir: filepath.Join(sb.Root(), "redis"), hold: -1}
	r.logPath = filepath.Join(r.dir, "redis.log")
	r.unregister = testsvc.Register(r.Close)
	if err := os.Mkdir(r.dir, 0o700); err != nil {
		_ = r.Close()
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	r.opMu.Lock()
	for range 5 {
		port, fd, perr := testsvc.PickPort()
		if perr != nil {
			err = perr
			break
		}
		r.mu.Lock()
		testsvc.UnholdPort(&r.hold)
		r.hold = fd
		r.mu.Unlock()
		if err = r.startOn(ctx, port); !errors.Is(err, errPortInUse) {
			break
		}
	}
	r.opMu.Unlock()
	if err != nil {
		_ = r.Close()
		return nil, err
	}
	return r, nil
}

// Addr is host:port for go-redis / asynq.
func (r *Redis) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(r.Port()))
}

// Dir is the temporary directory Close removes; redis-server runs in it.
func (r *Redis) Dir() string { return r.sb.Root() }

// Port is the loopback TCP port; it survives Stop/Kill and Start.
func (r *Redis) Port() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.port
}

// Running reports whether redis-server is alive.
func (r *Redis) Running() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.proc != nil && !r.proc.Exited()
}

func (r *Redis) current() *testsvc.Process {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.proc
}

func (r *Redis) startOn(ctx context.Context, port int) error {
	r.mu.Lock()
	closed := r.closed
	r.mu.Unlock()
	if closed {
		return errClosed
	}
	offset := testsvc.FileSize(r.logPath)
	lf, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	cmd := exec.Command(r.bin,
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", r.dir,
		"--daemonize", "no", "--logfile", "", "--loglevel", "warning")
	cmd.Dir = r.dir
	cmd.Env = serviceEnv(r.dir)
	cmd.Stdout, cmd.Stderr = lf, lf
	// Own process group: a terminal's Ctrl-C goes to our handler, not here.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	r.mu.Lock()
	testsvc.UnholdPort(&r.hold)
	r.mu.Unlock()
	p, err := testsvc.Spawn(cmd)
	_ = lf.Close()
	if err != nil {
		return fmt.Errorf("pgtest: start redis-server: %w", err)
	}
	r.sb.RecordPID("redis", p.PID())
	r.mu.Lock()
	r.proc, r.port = p, port
	r.mu.Unlock()

	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	for {
		if p.Exited() {
			r.sb.ForgetPID("redis")
			tail := testsvc.LogTail(r.logPath, offset)
			if strings.Contains(tail, "Address already in use") {
				return fmt.Errorf("%w: redis :%d", errPortInUse, port)
			}
			r.reserve()
			return fmt.Errorf("pgtest: redis-server exited during startup (%v); log %s:\n%s", p.Err(), r.logPath, tail)
		}
		if ping(ctx, addr) == nil {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 10*time.Millisecond); err != nil {
			_ = syscall.Kill(p.PID(), syscall.SIGKILL)
			p.Wait(5 * time.Second)
			r.sb.ForgetPID("redis")
			r.reserve()
			return fmt.Errorf("pgtest: redis-server on %s not answering PING: %w; log %s:\n%s", addr, err, r.logPath, testsvc.LogTail(r.logPath, offset))
		}
	}
}

// ping speaks just enough RESP to tell "accepting commands" from "port open";
// it keeps go-redis out of the harness's dependencies.
func ping(ctx context.Context, addr string) error {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	conn, err := d.DialContext(dctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(time.Second))
	if _, err := conn.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.HasPrefix(line, "+PONG") {
		return fmt.Errorf("pgtest: redis answered %q", strings.TrimSpace(line))
	}
	return nil
}

// Start restarts a stopped or killed server on the same port. The data is
// gone: persistence is off.
func (r *Redis) Start(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	r.opMu.Lock()
	defer r.opMu.Unlock()
	if r.Running() {
		return nil
	}
	return r.startOn(ctx, r.Port())
}

// Stop shuts redis-server down with SIGTERM and waits.
func (r *Redis) Stop() error {
	return r.halt(syscall.SIGTERM)
}

// Kill SIGKILLs redis-server and waits.
func (r *Redis) Kill() error {
	return r.halt(syscall.SIGKILL)
}

func (r *Redis) halt(sig syscall.Signal) error {
	r.opMu.Lock()
	defer r.opMu.Unlock()
	p := r.current()
	if p.Exited() {
		return nil
	}
	_ = syscall.Kill(p.PID(), sig)
	if !p.Wait(10 * time.Second) {
		_ = syscall.Kill(p.PID(), syscall.SIGKILL)
		if !p.Wait(5 * time.Second) {
			return fmt.Errorf("pgtest: redis-server (pid %d) did not exit", p.PID())
		}
	}
	r.sb.ForgetPID("redis")
	r.reserve()
	return nil
}

// reserve keeps the port while the server is down (see ports.go).
func (r *Redis) reserve() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed && r.hold < 0 && r.port != 0 {
		r.hold, _ = testsvc.HoldPort(r.port)
	}
}

// Close kills the server and removes its temp dir; idempotent.
func (r *Redis) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	r.mu.Unlock()
	err := r.Kill()
	r.mu.Lock()
	testsvc.UnholdPort(&r.hold)
	r.mu.Unlock()
	if rerr := r.sb.Remove(); err == nil {
		err = rerr
	}
	r.unregister()
	return err
}
