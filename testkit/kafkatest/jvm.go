package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// errClosed is returned by operations on a closed Broker or Connect, e.g.
// after the SIGINT/SIGTERM handler closed them under a running test.
var errClosed = errors.New("kafkatest: closed (by Close or by the SIGINT/SIGTERM handler)")

// errPortInUse marks a start that lost the race for one of its ports; only
// a fresh service, whose ports are not fixed yet, retries on others.
var errPortInUse = errors.New("kafkatest: port already in use")

// jvmDefaults start a small JVM quickly. On the loaded 2-core machines the
// tests run on, what costs is CPU at startup: C1 only (TieredStopAtLevel=1)
// roughly halves it and the broker never runs long enough to miss C2;
// SerialGC has no GC threads to compete with PostgreSQL. UsePerfData off
// keeps the JVM from leaving /tmp/hsperfdata_<user>/<pid> behind when it is
// SIGKILLed.
var jvmDefaults = []string{
	"-Xms32m",
	"-XX:+UseSerialGC",
	"-XX:TieredStopAtLevel=1",
	"-XX:-UsePerfData",
	"-XX:+ExitOnOutOfMemoryError",
	"-Djava.awt.headless=true",
}

// log4jConfig keeps the log readable: Kafka prints every configuration at
// INFO (hundreds of lines per client), which would push the cause of a
// failed start out of the tail that errors quote.
const log4jConfig = `status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = %d{HH:mm:ss.SSS} %-5p [%c{1}] %m%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = out
logger.config.name = org.apache.kafka.common.config
logger.config.level = warn
logger.appinfo.name = org.apache.kafka.common.utils.AppInfoParser
logger.appinfo.level = warn
`

// jvm is one long-running Java service in a sandbox: a process whose
// working directory is dir (so the sandbox's watchdog finds it), ports that
// stay reserved while it is down, and a readiness probe.
type jvm struct {
	name    string // "broker", "connect": PID file and error messages
	sb      *testsvc.Sandbox
	dir     string
	logPath string
	// ready returns nil once the service answers a real request.
	ready func(ctx context.Context) error

	opMu sync.Mutex // serialises start/stop/kill

	mu     sync.Mutex
	ports  []int
	holds  []int // sockets reserving ports while the JVM is down, or -1
	proc   *testsvc.Process
	closed bool
}

// defaultStartTimeout is the default of Options.StartTimeout and
// ConnectOptions.StartTimeout; the former says why it is so long.
const defaultStartTimeout = 3 * time.Minute

func startTimeout(d time.Duration) time.Duration {
	if d <= 0 {
		return defaultStartTimeout
	}
	return d
}

// resolveJava makes sure the jars (Resolve, with its own budget) and a
// usable java are there before a service starts.
func resolveJava(ctx context.Context, logf func(format string, args ...any)) (*Artifacts, error) {
	art, err := Resolve(ctx, logf)
	if err != nil {
		return nil, err
	}
	if _, err := javaBinary(); err != nil {
		return nil, err
	}
	return art, nil
}

// newJVM creates the service's sandbox, named after it, and its directory
// there.
func newJVM(name string) (*jvm, error) {
	sb, err := testsvc.NewSandbox("kafkatest-"+name+"-", false)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(sb.Root(), name)
	fail := func(err error) (*jvm, error) {
		_ = sb.Remove()
		return nil, fmt.Errorf("kafkatest: %w", err)
	}
	for _, d := range []string{dir, filepath.Join(dir, "tmp")} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return fail(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "log4j2.properties"), []byte(log4jConfig), 0o600); err != nil {
		return fail(err)
	}
	return &jvm{name: name, sb: sb, dir: dir, logPath: filepath.Join(dir, name+".log")}, nil
}

// startFresh runs fresh, which picks ports and starts the service on them,
// and again while it loses the race for a port (errPortInUse), up to five
// times. Only a fresh service may move: a started one's clients know its
// ports.
func (j *jvm) startFresh(ctx context.Context, fresh func(context.Context) error) error {
	j.opMu.Lock()
	defer j.opMu.Unlock()
	var err error
	for range 5 {
		if err = fresh(ctx); !errors.Is(err, errPortInUse) {
			break
		}
	}
	return err
}

// writeProperties writes a Java properties file: the harness's settings,
// with vars replaced, then the user's (after, so that they win) under a
// comment naming where they came from.
func writeProperties(path string, settings [][2]string, vars *strings.Replacer, user map[string]string, userFrom string) error {
	var b strings.Builder
	b.WriteString("# Written by testkit/kafkatest.\n")
	for _, kv := range settings {
		fmt.Fprintf(&b, "%s=%s\n", kv[0], vars.Replace(kv[1]))
	}
	keys := make([]string, 0, len(user))
	for k := range user {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	if len(keys) > 0 {
		fmt.Fprintf(&b, "# %s\n", userFrom)
	}
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%s\n", k, user[k])
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	return nil
}

// pickPorts reserves n fresh ports, releasing any held before.
func (j *jvm) pickPorts(n int) error {
	ports := make([]int, 0, n)
	holds := make([]int, 0, n)
	for range n {
		p, fd, err := testsvc.PickPort()
		if err != nil {
			for i := range holds {
				testsvc.UnholdPort(&holds[i])
			}
			return err
		}
		ports, holds = append(ports, p), append(holds, fd)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	for i := range j.holds {
		testsvc.UnholdPort(&j.holds[i])
	}
	j.ports, j.holds = ports, holds
	return nil
}

func (j *jvm) port(i int) int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.ports[i]
}

// javaCmd prepares a java command in dir with the harness's JVM options;
// extra come after the defaults and so override them.
func (j *jvm) javaCmd(heap string, extra []string, args ...string) (*exec.Cmd, error) {
	bin, err := javaBinary()
	if err != nil {
		return nil, err
	}
	argv := append([]string{}, jvmDefaults...)
	argv = append(argv, "-Xmx"+heap,
		"-Djava.io.tmpdir="+filepath.Join(j.dir, "tmp"),
		"-Dlog4j2.configurationFile="+filepath.Join(j.dir, "log4j2.properties"))
	argv = append(argv, extra...)
	argv = append(argv, args...)
	cmd := exec.Command(bin, argv...)
	cmd.Dir = j.dir
	// Own process group: a terminal's Ctrl-C goes to the test binary's
	// handler, which decides the order of shutdown.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd, nil
}

// run runs a short-lived Java program (StorageTool) to completion, appending
// its output to the service log; what names it in errors.
func (j *jvm) run(ctx context.Context, what string, cmd *exec.Cmd) error {
	offset := testsvc.FileSize(j.logPath)
	lf, err := os.OpenFile(j.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	cmd.Stdout, cmd.Stderr = lf, lf
	p, err := testsvc.Spawn(cmd)
	_ = lf.Close()
	if err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	select {
	case <-p.Done():
	case <-ctx.Done():
		_ = syscall.Kill(-p.PID(), syscall.SIGKILL)
		<-p.Done()
		return fmt.Errorf("kafkatest: %s: %w; log %s:\n%s", what, ctx.Err(), j.logPath, testsvc.LogTailN(j.logPath, offset, 30))
	}
	if err := p.Err(); err != nil {
		return fmt.Errorf("kafkatest: %s failed (%v); log %s:\n%s", what, err, j.logPath, testsvc.LogTailN(j.logPath, offset, 30))
	}
	return nil
}

// start spawns the JVM on the reserved ports and waits until ready answers.
// ctx bounds the wait; on failure the JVM is killed and the error quotes the
// log.
func (j *jvm) start(ctx context.Context, cmd *exec.Cmd) error {
	j.mu.Lock()
	closed := j.closed
	j.mu.Unlock()
	if closed {
		return errClosed
	}
	offset := testsvc.FileSize(j.logPath)
	lf, err := os.OpenFile(j.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	cmd.Stdout, cmd.Stderr = lf, lf
	j.mu.Lock()
	for i := range j.holds {
		testsvc.UnholdPort(&j.holds[i])
	}
	j.mu.Unlock()
	p, err := testsvc.Spawn(cmd)
	_ = lf.Close()
	if err != nil {
		j.reserve()
		return fmt.Errorf("kafkatest: start %s: %w", j.name, err)
	}
	j.sb.RecordPID(j.name, p.PID())
	j.mu.Lock()
	j.proc = p
	closed = j.closed
	j.mu.Unlock()
	if closed {
		// Close (from the signal handler) ran between the check above and
		// the spawn, and found nothing to stop.
		j.kill()
		return errClosed
	}

	began := time.Now()
	var last error
	for {
		if p.Exited() {
			j.afterExit()
			tail := testsvc.LogTailN(j.logPath, offset, 40)
			if strings.Contains(tail, "Address already in use") {
				return fmt.Errorf("%w: %s; log %s:\n%s", errPortInUse, j.name, j.logPath, tail)
			}
			return fmt.Errorf("kafkatest: %s exited during startup (%v); log %s:\n%s", j.name, p.Err(), j.logPath, tail)
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		last = j.ready(pctx)
		cancel()
		if last == nil {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 100*time.Millisecond); err != nil {
			j.kill()
			return fmt.Errorf("kafkatest: %s not ready after %v (%w; last probe: %v); if the machine is just overloaded, raise StartTimeout in the options; log %s:\n%s",
				j.name, time.Since(began).Round(time.Millisecond), err, last, j.logPath, testsvc.LogTailN(j.logPath, offset, 40))
		}
	}
}

func (j *jvm) current() *testsvc.Process {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.proc
}

func (j *jvm) running() bool {
	p := j.current()
	return p != nil && !p.Exited()
}

// halt sends sig and waits up to grace, then SIGKILLs.
func (j *jvm) halt(sig syscall.Signal, grace time.Duration) error {
	p := j.current()
	if p.Exited() {
		return nil
	}
	_ = syscall.Kill(p.PID(), sig)
	var err error
	if !p.Wait(grace) {
		if sig != syscall.SIGKILL {
			err = fmt.Errorf("kafkatest: %s did not stop within %v and was killed", j.name, grace)
		}
		_ = syscall.Kill(p.PID(), syscall.SIGKILL)
		if !p.Wait(10 * time.Second) {
			return fmt.Errorf("kafkatest: %s (pid %d) survived SIGKILL", j.name, p.PID())
		}
	}
	j.afterExit()
	return err
}

func (j *jvm) kill() { _ = j.halt(syscall.SIGKILL, 10*time.Second) }

// crash SIGKILLs the JVM, as a crash would, and waits.
func (j *jvm) crash() error {
	j.opMu.Lock()
	defer j.opMu.Unlock()
	return j.halt(syscall.SIGKILL, 10*time.Second)
}

// close stops the JVM for good (sig, then SIGKILL after grace), gives its
// ports back and removes its sandbox. Only the first call does anything.
func (j *jvm) close(sig syscall.Signal, grace time.Duration) error {
	if !j.markClosed() {
		return nil
	}
	j.opMu.Lock()
	err := j.halt(sig, grace)
	j.opMu.Unlock()
	j.releasePorts()
	if rerr := j.sb.Remove(); err == nil {
		err = rerr
	}
	return err
}

func (j *jvm) afterExit() {
	j.sb.ForgetPID(j.name)
	j.reserve()
}

// reserve keeps the ports while the JVM is down, so that a restart finds
// them free and clients meanwhile get "connection refused".
func (j *jvm) reserve() {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return
	}
	for i, p := range j.ports {
		if j.holds[i] < 0 {
			j.holds[i], _ = testsvc.HoldPort(p)
		}
	}
}

// markClosed makes later starts fail; it returns false if already closed.
func (j *jvm) markClosed() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return false
	}
	j.closed = true
	return true
}

func (j *jvm) releasePorts() {
	j.mu.Lock()
	defer j.mu.Unlock()
	for i := range j.holds {
		testsvc.UnholdPort(&j.holds[i])
	}
}
