package lab

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sys/unix"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/netns"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The partition scenarios put the worker's connections (the router's
// replica pools, the tracker's, the feed's and the fleet budget's Redis
// client) or the feed's publishers behind a veth link of their own
// (testkit/netns) and drop packets on it: a partition as a network makes
// it, where nothing is refused and TCP hangs until a timeout says
// otherwise. Every other client of the same servers (producers, the
// primary pools, asynq's Redis, the checker) stays in the root namespace
// and is not touched.
//
// Latency and loss are netem's, made without it (testkit/netns's Delay
// and Lose: the kernel lacks sch_netem).

// partitionUserTimeout is the worker's TCP_USER_TIMEOUT on replica
// connections: data unacknowledged that long fails the connection, as
// libpq's tcp_user_timeout does. A deployment needs one (or a query
// timeout): without it a read on a partitioned replica hangs for as long
// as the kernel retransmits, about 15 minutes.
const partitionUserTimeout = 3 * time.Second

// namespace returns the run's namespace for role, creating it the first
// time; it goes away with the run. A host that cannot create one fails
// the scenario with the reason.
func (r *run) namespace(role string) (*netns.Namespace, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ns := r.namespaces[role]; ns != nil {
		return ns, nil
	}
	ns, err := netns.New(role)
	if err != nil {
		return nil, fmt.Errorf("the partition scenarios need network namespaces: %w", err)
	}
	if r.namespaces == nil {
		r.namespaces = map[string]*netns.Namespace{}
	}
	r.namespaces[role] = ns
	r.closers = append(r.closers, func() { _ = ns.Close() })
	return ns, nil
}

// withUserTimeout dials with dial and sets TCP_USER_TIMEOUT on the
// connection.
func withUserTimeout(dial func(ctx context.Context, network, addr string) (net.Conn, error), d time.Duration) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		tc, ok := c.(*net.TCPConn)
		if !ok {
			return c, nil
		}
		raw, err := tc.SyscallConn()
		if err != nil {
			c.Close()
			return nil, err
		}
		var serr error
		if err := raw.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(d.Milliseconds()))
		}); err != nil || serr != nil {
			c.Close()
			return nil, errors.Join(err, serr)
		}
		return c, nil
	}
}

// workerReplicaPools are the router's replica pools, one per standby as
// newDBEnv's, dialing from the worker's namespace.
func workerReplicaPools(ctx context.Context, r *run) ([]replay.Replica, error) {
	ns, err := r.namespace("worker")
	if err != nil {
		return nil, err
	}
	var reps []replay.Replica
	for _, n := range r.env.replicaNodes {
		cfg, err := pgxpool.ParseConfig(n.DSN(r.env.name) + "&connect_timeout=2")
		if err != nil {
			return nil, err
		}
		cfg.MaxConns = 24
		cfg.ConnConfig.DialFunc = withUserTimeout(ns.DialContext, partitionUserTimeout)
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return nil, err
		}
		r.closers = append(r.closers, p.Close)
		reps = append(reps, replay.Replica{Name: n.Name(), Pool: p})
	}
	return reps, nil
}

// condLog samples a condition every 2ms and keeps its changes.
type condLog struct {
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	at     []time.Time
	val    []bool
}

func watchCond(cond func() bool) *condLog {
	ctx, cancel := context.WithCancel(context.Background())
	l := &condLog{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(l.done)
		t := time.NewTicker(2 * time.Millisecond)
		defer t.Stop()
		for {
			v := cond()
			l.mu.Lock()
			if n := len(l.val); n == 0 || l.val[n-1] != v {
				l.at, l.val = append(l.at, time.Now()), append(l.val, v)
			}
			l.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return l
}

func (l *condLog) stop() {
	l.cancel()
	<-l.done
}

// first is when the condition was first v at or after t: t itself if it
// already was.
func (l *condLog) first(t time.Time, v bool) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range l.at {
		if l.val[i] != v {
			continue
		}
		if !l.at[i].After(t) && (i+1 == len(l.at) || l.at[i+1].After(t)) {
			return t, true // v when t came
		}
		if l.at[i].After(t) {
			return l.at[i], true
		}
	}
	return time.Time{}, false
}

// replicaUnusable: the router's snapshot has replica name of "main" with
// an error, an observation older than the staleness bound, or out of
// recovery; what a decision would not send a job to.
func replicaUnusable(router *consume.Router, name string) func() bool {
	bound := router.Config().Tracker.StalenessBound
	return func() bool {
		db := router.Snapshot().Database("main")
		if db == nil {
			return true
		}
		for _, rs := range db.Replicas {
			if rs.Name == name {
				return rs.Err != nil || !rs.InRecovery || time.Since(rs.ObservedAt) > bound
			}
		}
		return true
	}
}

// partitionFault is one partition a fault made, for the notes and checks.
type partitionFault struct {
	what             string
	from, healed     time.Time
	noticed, cleared time.Time // zero: never seen
	watch            *condLog
}

type partitionState struct {
	mu     sync.Mutex
	faults []*partitionFault
	// budgetUnavailable0 is the fleet budget's unavailable count before
	// the faults (feed-redis partition).
	budgetUnavailable0 int64
}

func partitionsOf(r *run) *partitionState {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch st := r.state.(type) {
	case *partitionState:
		return st
	case *feedRun:
		if st.partitions == nil {
			st.partitions = &partitionState{}
		}
		return st.partitions
	}
	st := &partitionState{}
	r.state = st
	return st
}

// partition applies block (which returns its heal) for d from now and
// records when cond (the fault, as the router sees it) first held after
// the block and first stopped holding after the heal.
func partition(ctx context.Context, r *run, what string, d time.Duration, cond func() bool, block func() (func() error, error)) error {
	var heal func() error
	f, err := observeFault(ctx, r, what, cond,
		func() (err error) {
			if heal, err = block(); err == nil {
				r.event("partitioned: %s", what)
			}
			return err
		},
		func() (time.Time, error) {
			sleepCtx(ctx, d)
			healed := time.Now()
			return healed, heal()
		})
	if err != nil {
		return err
	}
	r.event("healed: %s; %s", what, f.timing())
	return nil
}

// observeFault runs a fault from begin until end, which returns when the
// fault was over, and records it for checkPartitions: when cond first
// held after begin, and when it first stopped holding after the end
// (waiting up to 10s for that).
func observeFault(ctx context.Context, r *run, what string, cond func() bool, begin func() error, end func() (time.Time, error)) (*partitionFault, error) {
	st := partitionsOf(r)
	f := &partitionFault{what: what, watch: watchCond(cond)}
	st.mu.Lock()
	st.faults = append(st.faults, f)
	st.mu.Unlock()
	defer f.watch.stop()
	f.from = time.Now()
	if err := begin(); err != nil {
		return nil, err
	}
	var err error
	if f.healed, err = end(); err != nil {
		return nil, err
	}
	waitFor(ctx, 10*time.Second, func() bool {
		_, back := f.watch.first(f.healed, false)
		return back
	})
	f.noticed, _ = f.watch.first(f.from, true)
	f.cleared, _ = f.watch.first(f.healed, false)
	return f, nil
}

// workerFault is where a fault on the worker's replica links starts: the
// worker's namespace and the replicas, once the scenario's lead is over.
func workerFault(ctx context.Context, r *run) (*netns.Namespace, []*pgtest.Node, error) {
	ns, err := r.namespace("worker")
	if err != nil {
		return nil, nil, err
	}
	if err := r.at(ctx, r.sl.lead); err != nil {
		return nil, nil, err
	}
	return ns, r.cluster.Replicas(), nil
}

func (f *partitionFault) timing() string {
	s := "never noticed"
	if !f.noticed.IsZero() {
		s = fmt.Sprintf("noticed %s after it began", f.noticed.Sub(f.from).Round(time.Millisecond))
	}
	if !f.cleared.IsZero() {
		s += fmt.Sprintf(", back %s after the heal", f.cleared.Sub(f.healed).Round(time.Millisecond))
	} else {
		s += ", not back within 10s of the heal"
	}
	return s
}

// checkPartitions fails a run whose partitions the router never noticed
// or never got over, and notes, for each, the time to notice and the
// reads decided during it: on the primary, and on each replica.
func checkPartitions(r *run, res *scenarioResult) {
	st := partitionsOf(r)
	st.mu.Lock()
	faults := append([]*partitionFault(nil), st.faults...)
	st.mu.Unlock()
	if len(faults) == 0 {
		r.fail("no partition was made")
		return
	}
	for _, f := range faults {
		if f.healed.IsZero() {
			r.fail("%s: not healed", f.what)
			continue
		}
		if f.noticed.IsZero() {
			r.fail("%s: the router never noticed", f.what)
		}
		if f.cleared.IsZero() {
			r.fail("%s: the router did not get over it within 10s of the heal", f.what)
		}
		r.note("%s for %s: %s; reads decided during it: %s", f.what, f.healed.Sub(f.from).Round(100*time.Millisecond), f.timing(),
			sortedCounts(readsOn(r, f.from, f.healed)))
	}
}

// readsOn counts the reads decided between from and to by the node they
// read: a replica's name, "primary" or "primary (fallback)".
func readsOn(r *run, from, to time.Time) map[string]int64 {
	on := map[string]int64{}
	for _, s := range r.streams() {
		for _, rd := range s.readsBetween(from, to) {
			name := rd.replica
			if name == "" {
				name = "primary"
				if rd.fallback {
					name = "primary (fallback)"
				}
			}
			on[name]++
		}
	}
	return on
}

// ---- worker ↔ replica ----

// partitionGap is the rest between two partitions of one scenario.
const partitionGap = time.Second

func partitionReplicaScenario(sl scale) *scenario {
	return &scenario{
		name: "partition-replica",
		about: fmt.Sprintf("the worker's connections to replica1 (router, tracker, handlers; in a network namespace) dropped both ways for %s, "+
			"then to both replicas for %s: TCP hangs, nothing is refused (TCP_USER_TIMEOUT %s)", sl.down, sl.down, partitionUserTimeout),
		policy:       consume.Delayed,
		replicaPools: workerReplicaPools,
		span:         func(s scale) time.Duration { return s.span(s.lead + 2*s.down + partitionGap + s.tail) },
		fault:        partitionReplicas,
		check:        checkPartitions,
	}
}

func partitionReplicas(ctx context.Context, r *run) error {
	ns, nodes, err := workerFault(ctx, r)
	if err != nil {
		return err
	}
	first := nodes[0]
	if err := partition(ctx, r, "worker ↔ "+first.Name(), r.sl.down, replicaUnusable(r.env.router, first.Name()),
		func() (func() error, error) { return ns.Block(first.Port(), netns.Both) }); err != nil {
		return err
	}
	sleepCtx(ctx, partitionGap)
	return partition(ctx, r, "worker ↔ "+names(nodes), r.sl.down, allUnusable(r.env.router, nodes),
		func() (func() error, error) { return blockAll(ns, nodes, netns.Both) })
}

func allUnusable(router *consume.Router, nodes []*pgtest.Node) func() bool {
	var conds []func() bool
	for _, n := range nodes {
		conds = append(conds, replicaUnusable(router, n.Name()))
	}
	return func() bool {
		for _, c := range conds {
			if !c() {
				return false
			}
		}
		return true
	}
}

// heals are the heal functions of faults applied together.
type heals []func() error

// add keeps heal, if the fault applied (err nil), and returns err.
func (hs *heals) add(heal func() error, err error) error {
	if err == nil {
		*hs = append(*hs, heal)
	}
	return err
}

// all heals every fault, once.
func (hs *heals) all() error {
	var errs []error
	for _, h := range *hs {
		errs = append(errs, h())
	}
	*hs = nil
	return errors.Join(errs...)
}

func blockAll(ns *netns.Namespace, nodes []*pgtest.Node, d netns.Direction) (func() error, error) {
	var hs heals
	for _, n := range nodes {
		if err := hs.add(ns.Block(n.Port(), d)); err != nil {
			return nil, errors.Join(err, hs.all())
		}
	}
	return hs.all, nil
}

// ---- asymmetric ----

func partitionAsymmetricScenario(sl scale) *scenario {
	return &scenario{
		name: "partition-asymmetric",
		about: fmt.Sprintf("one-way partitions of the worker's replica links (network namespace): replica1's answers dropped while the worker's "+
			"requests arrive, for %s; then replica2's requests dropped while its answers would pass, for %s", sl.down, sl.down),
		policy:       consume.Delayed,
		replicaPools: workerReplicaPools,
		span:         func(s scale) time.Duration { return s.span(s.lead + 2*s.down + partitionGap + s.tail) },
		fault:        partitionOneWay,
		check:        checkPartitions,
	}
}

func partitionOneWay(ctx context.Context, r *run) error {
	ns, nodes, err := workerFault(ctx, r)
	if err != nil {
		return err
	}
	for i, d := range []netns.Direction{netns.In, netns.Out} {
		n := nodes[i%len(nodes)]
		what := fmt.Sprintf("worker → %s only (answers dropped)", n.Name())
		if d == netns.Out {
			what = fmt.Sprintf("%s → worker only (requests dropped)", n.Name())
		}
		if err := partition(ctx, r, what, r.sl.down, replicaUnusable(r.env.router, n.Name()),
			func() (func() error, error) { return ns.Block(n.Port(), d) }); err != nil {
			return err
		}
		sleepCtx(ctx, partitionGap)
	}
	return nil
}

// ---- latency and loss ----

// The links' latency and loss in partition-latency: tc netem's
// "delay 200ms 100ms loss 1%", each way.
const (
	linkDelay   = 200 * time.Millisecond
	linkJitter  = 100 * time.Millisecond
	lossPercent = 1
)

func partitionLatencyScenario(sl scale) *scenario {
	return &scenario{
		name: "partition-latency",
		about: fmt.Sprintf("the worker's links to both replicas (network namespace) slowed to %s ± %s each way with %d%% loss for %s, "+
			"replay paused on both for %s in the middle", linkDelay, linkJitter, lossPercent, 2*sl.down, sl.down),
		policy:       consume.Delayed,
		replicaPools: workerReplicaPools,
		span:         func(s scale) time.Duration { return s.span(s.lead + 2*s.down + s.tail) },
		fault:        slowReplicas,
		check:        checkLoss,
	}
}

type lossState struct {
	from, to time.Time
}

func slowReplicas(ctx context.Context, r *run) error {
	ns, nodes, err := workerFault(ctx, r)
	if err != nil {
		return err
	}
	var hs heals
	defer hs.all()
	for _, n := range nodes {
		if err := hs.add(ns.Lose(n.Port(), lossPercent)); err != nil {
			return err
		}
		if err := hs.add(ns.Delay(n.Port(), linkDelay, linkJitter)); err != nil {
			return err
		}
	}
	st := &lossState{from: time.Now()}
	r.mu.Lock()
	r.state = st
	r.mu.Unlock()
	r.event("the worker's links to %s: %s ± %s each way, %d%% loss", names(nodes), linkDelay, linkJitter, lossPercent)
	if err := pauseAllAt(ctx, r, r.sl.lead+r.sl.down/2, r.sl.down, ""); err != nil {
		return err
	}
	if err := r.at(ctx, r.sl.lead+2*r.sl.down); err != nil {
		return err
	}
	err = hs.all()
	st.to = time.Now()
	r.event("the links are fast again")
	return err
}

func checkLoss(r *run, res *scenarioResult) {
	r.mu.Lock()
	st, _ := r.state.(*lossState)
	r.mu.Unlock()
	if st == nil || st.to.IsZero() {
		r.fail("the loss was never applied, or never ended")
		return
	}
	on := readsOn(r, st.from, st.to)
	r.note("reads decided while the links were slow: %s", sortedCounts(on))
	var onReplicas int64
	for node, n := range on {
		if !strings.HasPrefix(node, "primary") {
			onReplicas += n
		}
	}
	if onReplicas == 0 {
		r.fail("no job read a replica on the slow links: latency and %d%% loss should not take the replicas out", lossPercent)
	}
	expectDeferrals(r, res)
}

// ---- the feed's Redis and the publishers ----

func partitionFeedRedisScenario(sl scale) *scenario {
	return feedScenarioWith(&scenario{
		name: "partition-feed-redis",
		about: fmt.Sprintf("sticky policy, router on a signed feed with a fleet budget (%d/s) on the same Redis, its Redis client in a network namespace; "+
			"the worker ↔ Redis link dropped both ways for %s, replay paused on both replicas for the middle %s: the router polls by itself "+
			"and the per-process cap alone holds fallbacks (asynq's Redis is not partitioned)", scenarioBudgetRate, 2*sl.down, sl.down),
		policy: consume.Sticky,
		span:   func(s scale) time.Duration { return s.span(s.lead + 2*s.down + 2*s.tail) },
		fault:  partitionFeedRedis,
		check: func(r *run, res *scenarioResult) {
			checkPartitions(r, res)
			checkBudget(r, true)
		},
	}, feedSetup{routerNet: true, budget: scenarioBudgetRate})
}

func partitionFeedRedis(ctx context.Context, r *run) error {
	ns, err := r.namespace("worker")
	if err != nil {
		return err
	}
	st := partitionsOf(r)
	st.budgetUnavailable0 = budgetUnavailable(r)
	port := r.s.redis.Port()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	errc := make(chan error, 1)
	// Replay paused in the middle of the partition: jobs then need the
	// primary or a deferral while the budget cannot be asked.
	go func() { errc <- pauseAllAt(ctx, r, r.sl.lead+r.sl.down/2, r.sl.down, "") }()
	err = partition(ctx, r, "worker ↔ the feed's Redis", 2*r.sl.down, func() bool { return !r.env.router.Tracker().Feed().Active },
		func() (func() error, error) { return ns.Block(port, netns.Both) })
	return errors.Join(err, <-errc)
}

// budgetUnavailable is caughtup.consume.fallback.budget{result=unavailable}.
func budgetUnavailable(r *run) int64 {
	return r.metrics.sum("caughtup.consume.fallback.budget", "caughtup.result")["unavailable"]
}

func partitionPublisherScenario(sl scale) *scenario {
	return feedScenarioWith(&scenario{
		name: "partition-publisher",
		about: fmt.Sprintf("router on a signed feed of 2 publisher processes run in a network namespace; their links to replica1 dropped both ways "+
			"for %s, random replay pauses: the feed goes stale for replica1 and the router polls it by itself", 2*sl.down),
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + 2*s.down + 2*s.tail) },
		fault:  partitionPublishers,
		check:  checkPartitions,
	}, feedSetup{publisherNet: true})
}

func partitionPublishers(ctx context.Context, r *run) error {
	ns, err := r.namespace("publishers")
	if err != nil {
		return err
	}
	defer runPauser(r)()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	n := r.cluster.Replicas()[0]
	return partition(ctx, r, "publishers ↔ "+n.Name(), 2*r.sl.down, func() bool { return r.env.router.Tracker().Feed().LocalNodes > 0 },
		func() (func() error, error) { return ns.Block(n.Port(), netns.Both) })
}
