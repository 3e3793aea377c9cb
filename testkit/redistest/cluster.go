package redistest

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// ClusterOptions shape a Redis Cluster. The zero value is 3 masters with
// 1 replica each and a 1s node timeout.
type ClusterOptions struct {
	// Masters is the number of masters the 16384 slots are split over.
	// Default: 3, the fewest Redis Cluster accepts for a failover vote.
	Masters int
	// ReplicasPerMaster is each master's replicas.
	// Default: 1.
	ReplicasPerMaster int
	// NodeTimeout is cluster-node-timeout: a master unreachable this long
	// is failed over by its replica (which then waits up to about a
	// second more for its election).
	// Default: 1s, so that a failover takes a few seconds.
	NodeTimeout time.Duration
	// NoRedisCLI creates the cluster with CLUSTER MEET, ADDSLOTSRANGE and
	// REPLICATE from Go even when redis-cli is installed.
	NoRedisCLI bool
	// Args are more redis-server arguments for every node, e.g.
	// {"--rename-command", "SPUBLISH", ""} to play a server that lacks a
	// command.
	Args []string
}

func (o ClusterOptions) withDefaults() ClusterOptions {
	if o.Masters == 0 {
		o.Masters = 3
	}
	if o.ReplicasPerMaster == 0 {
		o.ReplicasPerMaster = 1
	}
	if o.NodeTimeout == 0 {
		o.NodeTimeout = time.Second
	}
	return o
}

// Cluster is a throwaway Redis Cluster on loopback: Masters masters, each
// with ReplicasPerMaster replicas, no persistence, every node running as
// the unprivileged service user when the test binary is root. Close (or
// the signal handler, or the sandbox's watchdog when the test binary dies)
// stops every node.
type Cluster struct {
	*deployment
	opts  ClusterOptions
	nodes []*Server
}

// StartCluster starts the nodes, joins them into one cluster (redis-cli
// --cluster create when redis-cli is installed, else the CLUSTER commands
// from Go) and waits until every node reports cluster_state:ok and every
// replica is attached to its master.
func StartCluster(ctx context.Context, opts ClusterOptions) (*Cluster, error) {
	opts = opts.withDefaults()
	d, err := newDeployment("redistest-cluster-", false)
	if err != nil {
		return nil, err
	}
	c := &Cluster{deployment: d, opts: opts}
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, time.Minute)
	defer cancel()
	n := opts.Masters * (1 + opts.ReplicasPerMaster)
	timeout := strconv.FormatInt(opts.NodeTimeout.Milliseconds(), 10)
	for i := range n {
		s, err := d.add("node-"+strconv.Itoa(i+1), func(port int) []string {
			args := append(baseArgs(port),
				"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
				"--cluster-node-timeout", timeout,
				// A replica takes over however long it was cut off: the
				// tests kill masters, not links.
				"--cluster-replica-validity-factor", "0",
				// Keep serving the slots that are still covered.
				"--cluster-require-full-coverage", "no")
			return append(args, opts.Args...)
		})
		if err != nil {
			_ = c.Close()
			return nil, err
		}
		c.nodes = append(c.nodes, s)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, s := range c.nodes {
		wg.Go(func() { errs[i] = s.firstStart(ctx) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		_ = c.Close()
		return nil, err
	}
	cli, haveCLI := testsvc.FindBinary("REDIS_CLI", "redis-cli", "/usr/bin/redis-cli")
	if haveCLI && !opts.NoRedisCLI {
		err = c.createWithCLI(ctx, cli)
	} else {
		err = c.createFromGo(ctx)
	}
	if err == nil {
		err = c.WaitHealthy(ctx)
	}
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

func (c *Cluster) createWithCLI(ctx context.Context, cli string) error {
	args := []string{"--cluster", "create"}
	for _, s := range c.nodes {
		args = append(args, s.Addr())
	}
	args = append(args, "--cluster-replicas", strconv.Itoa(c.opts.ReplicasPerMaster), "--cluster-yes")
	cmd := exec.CommandContext(ctx, cli, args...)
	cmd.Dir = c.sb.Root()
	cmd.Env = serviceEnv(c.sb.Root())
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("redistest: redis-cli --cluster create: %w\n%s", err, out)
	}
	return nil
}

// createFromGo is what redis-cli --cluster create does: every node meets
// the first, the first Masters nodes get a contiguous share of the slots,
// and the others replicate them in turn.
func (c *Cluster) createFromGo(ctx context.Context) error {
	clients := make([]*redis.Client, len(c.nodes))
	for i, s := range c.nodes {
		clients[i] = redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
		defer func() { _ = clients[i].Close() }()
	}
	ids := make([]string, len(c.nodes))
	for i, cl := range clients {
		id, err := cl.Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			return fmt.Errorf("redistest: CLUSTER MYID on %s: %w", c.nodes[i].name, err)
		}
		ids[i] = id
	}
	m := c.opts.Masters
	for i := range m {
		lo, hi := i*16384/m, (i+1)*16384/m-1
		if err := clients[i].Do(ctx, "CLUSTER", "ADDSLOTSRANGE", lo, hi).Err(); err != nil {
			return fmt.Errorf("redistest: CLUSTER ADDSLOTSRANGE on %s: %w", c.nodes[i].name, err)
		}
	}
	for i := 1; i < len(clients); i++ {
		if err := clients[i].ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(c.nodes[0].Port())).Err(); err != nil {
			return fmt.Errorf("redistest: CLUSTER MEET from %s: %w", c.nodes[i].name, err)
		}
	}
	// REPLICATE needs the replica to know its master, which gossip takes
	// a moment to tell it.
	for i := m; i < len(clients); i++ {
		master := ids[(i-m)%m]
		for {
			err := clients[i].Do(ctx, "CLUSTER", "REPLICATE", master).Err()
			if err == nil {
				break
			}
			if !strings.Contains(err.Error(), "Unknown node") {
				return fmt.Errorf("redistest: CLUSTER REPLICATE on %s: %w", c.nodes[i].name, err)
			}
			if err := testsvc.SleepCtx(ctx, 20*time.Millisecond); err != nil {
				return fmt.Errorf("redistest: %s never learned of its master: %w", c.nodes[i].name, err)
			}
		}
	}
	return nil
}

// Addrs are every node's addresses, for redis.UniversalOptions.Addrs or
// redis.ClusterOptions.Addrs.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, s := range c.nodes {
		addrs[i] = s.Addr()
	}
	return addrs
}

// Nodes are the cluster's servers, in the order they were created (the
// first Masters were the masters then; failovers change that: see
// MasterOf).
func (c *Cluster) Nodes() []*Server { return c.nodes }

// Options are the options the cluster was started with, defaults filled.
func (c *Cluster) Options() ClusterOptions { return c.opts }

// Dir is the temporary directory Close removes; every node runs in it.
func (c *Cluster) Dir() string { return c.sb.Root() }

func (c *Cluster) byAddr(addr string) *Server {
	for _, s := range c.nodes {
		if s.Addr() == addr {
			return s
		}
	}
	return nil
}

// client connects to one running node.
func (c *Cluster) client() (*redis.Client, error) {
	for _, s := range c.nodes {
		if s.Running() {
			return redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second}), nil
		}
	}
	return nil, errors.New("redistest: no cluster node is running")
}

// MasterOf returns the node that serves key's slot as master, as a
// running node's CLUSTER SLOTS says.
func (c *Cluster) MasterOf(ctx context.Context, key string) (*Server, error) {
	cl, err := c.client()
	if err != nil {
		return nil, err
	}
	defer func() { _ = cl.Close() }()
	slot, err := cl.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return nil, fmt.Errorf("redistest: CLUSTER KEYSLOT: %w", err)
	}
	slots, err := cl.ClusterSlots(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("redistest: CLUSTER SLOTS: %w", err)
	}
	for _, r := range slots {
		if int64(r.Start) <= slot && slot <= int64(r.End) && len(r.Nodes) > 0 {
			if s := c.byAddr(r.Nodes[0].Addr); s != nil {
				return s, nil
			}
			return nil, fmt.Errorf("redistest: slot %d is served by %s, not a node of this cluster", slot, r.Nodes[0].Addr)
		}
	}
	return nil, fmt.Errorf("redistest: slot %d is not served", slot)
}

// WaitHealthy waits until every running node reports cluster_state:ok,
// each running node agrees that every slot's master is a running node,
// and every running replica's link to its master is up.
func (c *Cluster) WaitHealthy(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, time.Minute)
	defer cancel()
	var last error
	for {
		if last = c.healthy(ctx); last == nil {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 20*time.Millisecond); err != nil {
			return fmt.Errorf("redistest: cluster not healthy: %w (last: %v)", err, last)
		}
	}
}

func (c *Cluster) healthy(ctx context.Context) error {
	var first string // one node's slot map, which every other must share
	for _, s := range c.nodes {
		if !s.Running() {
			continue
		}
		err := func() error {
			cl := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
			defer func() { _ = cl.Close() }()
			info, err := cl.ClusterInfo(ctx).Result()
			if err != nil {
				return err
			}
			if !strings.Contains(info, "cluster_state:ok") {
				return fmt.Errorf("%s: not cluster_state:ok", s.name)
			}
			slots, err := cl.ClusterSlots(ctx).Result()
			if err != nil {
				return err
			}
			covered := 0
			var view strings.Builder
			for _, r := range slots {
				if len(r.Nodes) > 0 {
					fmt.Fprintf(&view, "%d-%d@%s ", r.Start, r.End, r.Nodes[0].Addr)
				}
				if len(r.Nodes) == 0 {
					continue
				}
				if m := c.byAddr(r.Nodes[0].Addr); m == nil || !m.Running() {
					return fmt.Errorf("%s: slots %d-%d on %s, which is down", s.name, r.Start, r.End, r.Nodes[0].Addr)
				}
				covered += r.End - r.Start + 1
			}
			if covered != 16384 {
				return fmt.Errorf("%s: %d of 16384 slots served", s.name, covered)
			}
			if first == "" {
				first = view.String()
			} else if first != view.String() {
				return fmt.Errorf("nodes disagree on the slots' masters: %s; %s: %s", first, s.name, view.String())
			}
			repl, err := cl.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
				return fmt.Errorf("%s: replica not linked to its master", s.name)
			}
			return nil
		}()
		if err != nil {
			return err
		}
	}
	return nil
}

// Close kills every node and removes the sandbox; idempotent.
func (c *Cluster) Close() error { return c.close() }
