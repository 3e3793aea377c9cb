package lab

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/netns"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// feedTools runs the feed scenarios' publishers as processes of their
// own (`caughtup feed`), so that SIGKILL, SIGTERM and SIGSTOP hit a real
// process: a stopped publisher's messages then arrive late exactly as they
// would from a frozen sidecar. The caughtup binary is the one -caughtup
// names (-caughtup), else it is built once per suite
// with `go build` from this module. The processes run inside a sandbox
// (testkit/testsvc), whose watchdog kills them if the suite dies.
type feedTools struct {
	given string // -caughtup

	once       sync.Once
	bin        string
	err        error
	sb         *testsvc.Sandbox
	unregister func()

	mu    sync.Mutex
	procs map[*publisherProc]bool
	seq   int
}

// binary returns the caughtup binary, building it the first time.
func (t *feedTools) binary(ctx context.Context, out *progress) (string, error) {
	t.once.Do(func() {
		if t.sb, t.err = testsvc.NewSandbox("caughtup-chaos-feed-", false); t.err != nil {
			return
		}
		t.unregister = testsvc.Register(t.close)
		if t.given != "" {
			t.bin, t.err = filepath.Abs(t.given)
			return
		}
		t.bin = filepath.Join(t.sb.Root(), "caughtup")
		began := time.Now()
		cmd := exec.CommandContext(ctx, "go", "build", "-o", t.bin, "github.com/caughtup/caughtup/cmd/caughtup")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.err = fmt.Errorf("building the caughtup command for the feed publishers failed (run from the module, or pass -caughtup PATH): %v\n%s", err, b)
			return
		}
		out.say("built the caughtup command for the feed publishers in %s", time.Since(began).Round(100*time.Millisecond))
	})
	return t.bin, t.err
}

// close kills every publisher still running and removes the sandbox.
func (t *feedTools) close() error {
	t.mu.Lock()
	procs := make([]*publisherProc, 0, len(t.procs))
	for p := range t.procs {
		procs = append(procs, p)
	}
	t.mu.Unlock()
	for _, p := range procs {
		p.kill()
	}
	if t.sb == nil {
		return nil
	}
	err := t.sb.Remove()
	if t.unregister != nil {
		t.unregister()
	}
	return err
}

// publisherArgs describes one `caughtup feed` process.
type publisherArgs struct {
	name string
	feed string
	keys string // CAUGHTUP_FEED_KEYS
	// redisURL and redisMode are --redis and --redis-mode (short client
	// timeouts: a restarted Redis is reached again within a second).
	redisURL, redisMode string
	primary             string            // connection string (multi-host in the suite)
	replicas            map[string]string // name → connection string
	// ns, if set, is the network namespace the publisher runs in; the
	// addresses above are the root namespace's, rewritten for it.
	ns *netns.Namespace
}

// publisherProc is one running `caughtup feed`.
type publisherProc struct {
	t       *feedTools
	name    string
	pidName string
	logPath string
	p       *testsvc.Process

	mu      sync.Mutex
	stopped bool // SIGSTOPped
}

// start runs `caughtup feed` for a's database as publisher a.name.
func (t *feedTools) start(ctx context.Context, out *progress, a publisherArgs) (*publisherProc, error) {
	bin, err := t.binary(ctx, out)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.seq++
	pidName := fmt.Sprintf("publisher-%d", t.seq)
	t.mu.Unlock()
	args := []string{"feed", "--database", "main", "--primary", a.primary,
		"--redis", a.redisURL, "--redis-mode", a.redisMode,
		"--feed", a.feed, "--name", a.name, "--interval", replay.DefaultFeedInterval.String()}
	for name, dsn := range a.replicas {
		args = append(args, "--replica", name+"="+dsn)
	}
	logPath := filepath.Join(t.sb.Root(), pidName+".log")
	lf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	if a.ns != nil {
		for i := range args {
			args[i] = a.ns.Addr(args[i])
		}
		cmd = a.ns.Command(bin, args...)
	}
	// Inside the sandbox: its watchdog sweeps processes by working
	// directory.
	cmd.Dir = t.sb.Root()
	cmd.Env = append(os.Environ(), "CAUGHTUP_FEED_KEYS="+a.keys)
	cmd.Stdout, cmd.Stderr = lf, lf
	// Its own process group: a terminal's Ctrl-C reaches the suite, which
	// kills it, not the publisher directly.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	p, err := testsvc.Spawn(cmd)
	_ = lf.Close()
	if err != nil {
		return nil, fmt.Errorf("start caughtup feed: %w", err)
	}
	t.sb.RecordPID(pidName, p.PID())
	pp := &publisherProc{t: t, name: a.name, pidName: pidName, logPath: logPath, p: p}
	t.mu.Lock()
	if t.procs == nil {
		t.procs = map[*publisherProc]bool{}
	}
	t.procs[pp] = true
	t.mu.Unlock()
	return pp, nil
}

func (p *publisherProc) pid() int { return p.p.PID() }

// exited says whether the process has ended, and how, with its log's tail.
func (p *publisherProc) exited() (bool, string) {
	if !p.p.Exited() {
		return false, ""
	}
	return true, fmt.Sprintf("%v; log:\n%s", p.p.Err(), testsvc.LogTail(p.logPath, 0))
}

// signal sends sig, keeping track of SIGSTOP and SIGCONT.
func (p *publisherProc) signal(sig syscall.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.p.Exited() {
		return fmt.Errorf("publisher %s (pid %d) has exited: %v", p.name, p.pid(), p.p.Err())
	}
	if err := syscall.Kill(p.pid(), sig); err != nil {
		return fmt.Errorf("%v to publisher %s (pid %d): %w", sig, p.name, p.pid(), err)
	}
	switch sig {
	case syscall.SIGSTOP:
		p.stopped = true
	case syscall.SIGCONT:
		p.stopped = false
	}
	return nil
}

// terminate ends the process with sig (SIGTERM: it closes its publisher
// and exits; SIGKILL: it vanishes) and waits for it.
func (p *publisherProc) terminate(sig syscall.Signal) error {
	p.mu.Lock()
	stopped := p.stopped
	p.mu.Unlock()
	if !p.p.Exited() {
		_ = syscall.Kill(p.pid(), sig)
		if stopped && sig != syscall.SIGKILL {
			_ = syscall.Kill(p.pid(), syscall.SIGCONT)
		}
	}
	var err error
	if !p.p.Wait(15 * time.Second) {
		_ = syscall.Kill(p.pid(), syscall.SIGKILL)
		p.p.Wait(5 * time.Second)
		err = fmt.Errorf("publisher %s (pid %d) did not exit on %v; killed", p.name, p.pid(), sig)
	}
	p.t.sb.ForgetPID(p.pidName)
	p.t.mu.Lock()
	delete(p.t.procs, p)
	p.t.mu.Unlock()
	return err
}

func (p *publisherProc) kill() { _ = p.terminate(syscall.SIGKILL) }

// feedObserver is the suite's own subscriber to a scenario's feed: it
// records, per publisher name, what arrived and how old it was, so that a
// scenario can show that a publisher stopped, came back, or delivered
// late. It believes what the routers believe (the same keys).
type feedObserver struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu  sync.Mutex
	per map[string]*publisherSeen
}

// publisherSeen is what the observer received from one publisher name.
type publisherSeen struct {
	count    int
	last     time.Time // receipt
	instance uint64
	// late counts deliveries whose observation was older than lateAge
	// when received (the publisher held it: stopped between its poll and
	// its send); maxAge is the oldest such age.
	late   int
	maxAge time.Duration
}

// lateAge: an observation received this long after its poll started was
// held by a stalled publisher; a running one sends within milliseconds.
const lateAge = 250 * time.Millisecond

func startObserver(rdb redis.UniversalClient, name string, keys feed.Keyring, s *services) (*feedObserver, error) {
	o := &feedObserver{per: map[string]*publisherSeen{}, done: make(chan struct{})}
	sub, err := feed.NewSubscriber(feed.SubscriberConfig{
		Client: rdb, Feed: name, Keys: keys, Logger: s.log,
		OnObservation: func(d feed.Delivery) {
			o.mu.Lock()
			defer o.mu.Unlock()
			ps := o.per[d.Publisher.Name]
			if ps == nil {
				ps = &publisherSeen{}
				o.per[d.Publisher.Name] = ps
			}
			ps.count++
			ps.last, ps.instance = d.ReceivedAt, d.Publisher.Instance
			if !d.Stored && d.Age > lateAge {
				ps.late++
				ps.maxAge = max(ps.maxAge, d.Age)
			}
		},
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	o.cancel = cancel
	go func() {
		defer close(o.done)
		_ = sub.Run(ctx)
	}()
	return o, nil
}

func (o *feedObserver) stop() {
	o.cancel()
	<-o.done
}

// seen returns a copy of what arrived from publisher name.
func (o *feedObserver) seen(name string) publisherSeen {
	o.mu.Lock()
	defer o.mu.Unlock()
	if ps := o.per[name]; ps != nil {
		return *ps
	}
	return publisherSeen{}
}

// waitFor polls cond every 10ms until it holds (true) or d passes or ctx
// ends (false).
func waitFor(ctx context.Context, d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		sleepCtx(ctx, 10*time.Millisecond)
	}
}

// errNotPublishing is a publisher process that never published.
var errNotPublishing = errors.New("the publisher process published nothing")

// waitPublishing waits until the observer hears from a new instance of
// publisher p (one it had not heard before since), or p exits.
func (o *feedObserver) waitPublishing(ctx context.Context, p *publisherProc, before publisherSeen) error {
	ok := waitFor(ctx, 60*time.Second, func() bool {
		if done, _ := p.exited(); done {
			return true
		}
		s := o.seen(p.name)
		return s.count > before.count && s.instance != before.instance
	})
	if done, why := p.exited(); done {
		return fmt.Errorf("publisher %s exited: %s", p.name, why)
	}
	if !ok {
		return fmt.Errorf("%w within 60s: %s, log:\n%s", errNotPublishing, p.name, testsvc.LogTail(p.logPath, 0))
	}
	return nil
}

// clientPorts are the local ports of the process's TCP connections to
// remotePort on the loopback interface, from /proc: its sockets' inodes
// (/proc/<pid>/fd), looked up in its network namespace's TCP tables.
func (p *publisherProc) clientPorts(remotePort int) ([]int, error) {
	dir := fmt.Sprintf("/proc/%d", p.pid())
	fds, err := os.ReadDir(dir + "/fd")
	if err != nil {
		return nil, err
	}
	inodes := map[string]bool{}
	for _, fd := range fds {
		if l, err := os.Readlink(dir + "/fd/" + fd.Name()); err == nil {
			if ino, ok := strings.CutPrefix(l, "socket:["); ok {
				inodes[strings.TrimSuffix(ino, "]")] = true
			}
		}
	}
	var ports []int
	for _, table := range []string{"/net/tcp", "/net/tcp6"} {
		b, err := os.ReadFile(dir + table)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			if len(f) < 10 || !inodes[f[9]] {
				continue
			}
			local, remote := hexPort(f[1]), hexPort(f[2])
			if remote == remotePort && local > 0 {
				ports = append(ports, local)
			}
		}
	}
	return ports, nil
}

// hexPort is the port of a /proc/net/tcp address ("0100007F:1F90").
func hexPort(addr string) int {
	_, h, ok := strings.Cut(addr, ":")
	if !ok {
		return -1
	}
	n, err := strconv.ParseInt(h, 16, 32)
	if err != nil {
		return -1
	}
	return int(n)
}
