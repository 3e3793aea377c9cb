package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// SentinelOptions shape a Sentinel set. The zero value is 1 master, 2
// replicas and 3 sentinels with quorum 2, a 1s down-after and a 3s
// failover timeout.
type SentinelOptions struct {
	// MasterName is the master set's name.
	// Default: "mymaster".
	MasterName string
	// Replicas of the master.
	// Default: 2.
	Replicas int
	// Sentinels watching the set.
	// Default: 3.
	Sentinels int
	// Quorum: sentinels that must agree the master is down.
	// Default: 2.
	Quorum int
	// DownAfter is down-after-milliseconds: a master silent this long is
	// subjectively down.
	// Default: 1s, so that a failover takes a few seconds.
	DownAfter time.Duration
	// FailoverTimeout is failover-timeout.
	// Default: 3s.
	FailoverTimeout time.Duration
}

func (o SentinelOptions) withDefaults() SentinelOptions {
	if o.MasterName == "" {
		o.MasterName = "mymaster"
	}
	if o.Replicas == 0 {
		o.Replicas = 2
	}
	if o.Sentinels == 0 {
		o.Sentinels = 3
	}
	if o.Quorum == 0 {
		o.Quorum = 2
	}
	if o.DownAfter == 0 {
		o.DownAfter = time.Second
	}
	if o.FailoverTimeout == 0 {
		o.FailoverTimeout = 3 * time.Second
	}
	return o
}

// Sentinel is a throwaway Sentinel set on loopback: a master, its
// replicas and the sentinels that fail it over, no persistence, every
// process running as the unprivileged service user when the test binary
// is root. Close (or the signal handler, or the sandbox's watchdog when
// the test binary dies) stops them all.
type Sentinel struct {
	*deployment
	opts      SentinelOptions
	data      []*Server // the master first, then the replicas, as started
	sentinels []*Server
}

// StartSentinel starts the master, the replicas (waiting until each has
// synced) and the sentinels (waiting until each knows every replica and
// every other sentinel).
func StartSentinel(ctx context.Context, opts SentinelOptions) (*Sentinel, error) {
	opts = opts.withDefaults()
	d, err := newDeployment("redistest-sentinel-", false)
	if err != nil {
		return nil, err
	}
	s := &Sentinel{deployment: d, opts: opts}
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, time.Minute)
	defer cancel()
	fail := func(err error) (*Sentinel, error) {
		_ = s.Close()
		return nil, err
	}
	master, err := d.add("master", baseArgs)
	if err != nil {
		return fail(err)
	}
	s.data = append(s.data, master)
	if err := master.firstStart(ctx); err != nil {
		return fail(err)
	}
	for i := range opts.Replicas {
		r, err := d.add("replica-"+strconv.Itoa(i+1), func(port int) []string {
			// The first start replicates the first master; a restart
			// comes up as a replica of the same address and the sentinels
			// re-point it at whichever is master now.
			return append(baseArgs(port), "--replicaof", "127.0.0.1", strconv.Itoa(master.Port()))
		})
		if err != nil {
			return fail(err)
		}
		s.data = append(s.data, r)
		if err := r.firstStart(ctx); err != nil {
			return fail(err)
		}
	}
	for _, r := range s.data[1:] {
		if err := waitLinked(ctx, r); err != nil {
			return fail(err)
		}
	}
	for i := range opts.Sentinels {
		sn, err := d.add("sentinel-"+strconv.Itoa(i+1), nil)
		if err != nil {
			return fail(err)
		}
		conf := filepath.Join(sn.Dir(), "sentinel.conf")
		sn.args = func(port int) []string {
			return []string{conf, "--sentinel", "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
				"--daemonize", "no", "--logfile", "", "--protected-mode", "no"}
		}
		// Sentinel rewrites its config file as it learns, so it must own it.
		text := fmt.Sprintf("sentinel monitor %s 127.0.0.1 %d %d\n"+
			"sentinel down-after-milliseconds %[1]s %[4]d\n"+
			"sentinel failover-timeout %[1]s %[5]d\n"+
			"sentinel parallel-syncs %[1]s 1\n",
			opts.MasterName, master.Port(), opts.Quorum, opts.DownAfter.Milliseconds(), opts.FailoverTimeout.Milliseconds())
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			return fail(err)
		}
		if err := testsvc.ChownService(conf); err != nil {
			return fail(err)
		}
		s.sentinels = append(s.sentinels, sn)
		if err := sn.firstStart(ctx); err != nil {
			return fail(err)
		}
	}
	if err := s.WaitSettled(ctx); err != nil {
		return fail(err)
	}
	return s, nil
}

func waitLinked(ctx context.Context, r *Server) error {
	cl := redis.NewClient(&redis.Options{Addr: r.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	defer func() { _ = cl.Close() }()
	for {
		info, err := cl.Info(ctx, "replication").Result()
		if err == nil && strings.Contains(info, "master_link_status:up") {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 20*time.Millisecond); err != nil {
			return fmt.Errorf("redistest: %s never synced with its master: %w; log:\n%s", r.name, err, r.Log())
		}
	}
}

// MasterName is the master set's name, for redis.UniversalOptions.MasterName.
func (s *Sentinel) MasterName() string { return s.opts.MasterName }

// SentinelAddrs are the sentinels' addresses, for
// redis.UniversalOptions.Addrs with MasterName.
func (s *Sentinel) SentinelAddrs() []string {
	addrs := make([]string, len(s.sentinels))
	for i, sn := range s.sentinels {
		addrs[i] = sn.Addr()
	}
	return addrs
}

// Servers are the master and replicas as first started (failovers swap
// roles: see Master).
func (s *Sentinel) Servers() []*Server { return s.data }

// Sentinels are the sentinel processes.
func (s *Sentinel) Sentinels() []*Server { return s.sentinels }

// Options are the options the set was started with, defaults filled.
func (s *Sentinel) Options() SentinelOptions { return s.opts }

// Dir is the temporary directory Close removes; every process runs in it.
func (s *Sentinel) Dir() string { return s.sb.Root() }

// Master returns the server that a running sentinel names as master.
func (s *Sentinel) Master(ctx context.Context) (*Server, error) {
	var last error
	for _, sn := range s.sentinels {
		if !sn.Running() {
			continue
		}
		addr, err := masterAddr(ctx, sn, s.opts.MasterName)
		if err != nil {
			last = err
			continue
		}
		for _, d := range s.data {
			if d.Addr() == addr {
				return d, nil
			}
		}
		return nil, fmt.Errorf("redistest: %s names %s as master, not a server of this set", sn.name, addr)
	}
	if last == nil {
		last = errors.New("no sentinel is running")
	}
	return nil, fmt.Errorf("redistest: %w", last)
}

func masterAddr(ctx context.Context, sn *Server, name string) (string, error) {
	cl := redis.NewSentinelClient(&redis.Options{Addr: sn.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	defer func() { _ = cl.Close() }()
	hp, err := cl.GetMasterAddrByName(ctx, name).Result()
	if err != nil {
		return "", err
	}
	if len(hp) != 2 {
		return "", fmt.Errorf("get-master-addr-by-name: %v", hp)
	}
	return net.JoinHostPort(hp[0], hp[1]), nil
}

// WaitSettled waits until every running sentinel names the same running
// master, which answers as a master, knows every other running sentinel
// and sees every other running server as a replica whose link to that
// master is up.
func (s *Sentinel) WaitSettled(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, time.Minute)
	defer cancel()
	var last error
	for {
		if last = s.settled(ctx); last == nil {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 50*time.Millisecond); err != nil {
			return fmt.Errorf("redistest: sentinel set not settled: %w (last: %v)", err, last)
		}
	}
}

func (s *Sentinel) settled(ctx context.Context) error {
	var master string
	running := 0
	for _, sn := range s.sentinels {
		if sn.Running() {
			running++
		}
	}
	for _, sn := range s.sentinels {
		if !sn.Running() {
			continue
		}
		addr, err := masterAddr(ctx, sn, s.opts.MasterName)
		if err != nil {
			return fmt.Errorf("%s: %w", sn.name, err)
		}
		if master != "" && addr != master {
			return fmt.Errorf("sentinels disagree: %s and %s", master, addr)
		}
		master = addr
		err = func() error {
			cl := redis.NewSentinelClient(&redis.Options{Addr: sn.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
			defer func() { _ = cl.Close() }()
			m, err := cl.Master(ctx, s.opts.MasterName).Result()
			if err != nil {
				return err
			}
			if flags := m["flags"]; flags != "master" {
				return fmt.Errorf("%s: master flags %q", sn.name, flags)
			}
			if n, _ := strconv.Atoi(m["num-other-sentinels"]); n < running-1 {
				return fmt.Errorf("%s: knows %d other sentinels of %d", sn.name, n, running-1)
			}
			return nil
		}()
		if err != nil {
			return err
		}
	}
	if master == "" {
		return errors.New("no sentinel is running")
	}
	for _, d := range s.data {
		if !d.Running() {
			continue
		}
		err := func() error {
			cl := redis.NewClient(&redis.Options{Addr: d.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
			defer func() { _ = cl.Close() }()
			info, err := cl.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if d.Addr() == master {
				if !strings.Contains(info, "role:master") {
					return fmt.Errorf("%s is named master but is not one yet", d.name)
				}
				return nil
			}
			port := strconv.Itoa(d.Port())
			_, mport, _ := net.SplitHostPort(master)
			if !strings.Contains(info, "role:slave") || !strings.Contains(info, "master_port:"+mport+"\r") || !strings.Contains(info, "master_link_status:up") {
				return fmt.Errorf("%s (:%s) is not yet a synced replica of %s", d.name, port, master)
			}
			return nil
		}()
		if err != nil {
			return err
		}
	}
	return nil
}

// Close kills every process, the sentinels first, and removes the
// sandbox; idempotent.
func (s *Sentinel) Close() error { return s.close() }
