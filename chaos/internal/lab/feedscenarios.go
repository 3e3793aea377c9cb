package lab

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/netns"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The feed scenarios: the scenario's router takes replica and primary
// positions from a signed position feed (consume.Config.Feed) that two
// `caughtup feed` processes (pub-a and pub-b, every 10ms) publish to the
// suite's redis-server, while replay pauses come and go on the replicas,
// so that a router believing a stale or false position would read stale
// rows. Each fault hits the feed:
//
//   - feed-publisher-kill: pub-a SIGKILLed; pub-b keeps the feed going.
//   - feed-publishers-stopped: both stopped (SIGTERM); the router falls
//     back to its own polls (counted), then both start again and it
//     returns to the feed.
//   - feed-redis-restart: redis-server restarted under the feed, the
//     asynq queues and the fleet's subscriptions (as redis-restart, with
//     the router on the feed): it polls by itself while Redis is away.
//   - feed-publisher-sigstop: pub-a (and once both) frozen with SIGSTOP
//     for 1-7s, so that what they had polled arrives late, some of it
//     past the router's staleness bound and MaxDelay.
//   - feed-failover: a promotion (on a cluster of its own) while the
//     router is on the feed; the publishers follow the primary through a
//     multi-host read-write URL.
//   - forged-feed (forged.go): forged, unsigned, replayed and impossible
//     messages injected with a plain Redis client during a long pause.

// feedRun is a feed scenario's state (run.state).
type feedRun struct {
	name    string // the feed's
	keys    feed.Keyring
	keyText string // CAUGHTUP_FEED_KEYS of the publishers
	rdb     redis.UniversalClient
	obs     *feedObserver
	pauser  *pauser
	mon     *feedMonitor

	// switches0 are the router's feed switches, by direction and by
	// state, once it first took every node from the feed: the start (the
	// feed silent until the publishers came) is not the fault's.
	switches0 map[string]int64

	mu   sync.Mutex
	pubs map[string]*publisherProc // the current process of each publisher name

	// What the fault saw, for its check.
	killedHeard, survivorHeard int // feed-publisher-kill
	late                       publisherSeen
	stops                      int
	forged                     *forgedState
	// pubNS: the publishers run in this namespace (feedSetup.publisherNet);
	// partitions: what the partition scenarios did.
	pubNS      *netns.Namespace
	partitions *partitionState
	// deployment: the feed's Redis Cluster or Sentinel set
	// (feedSetup.deployment), nil on the suite's redis-server.
	deployment *feedDeployment
}

func feedOf(r *run) *feedRun {
	r.mu.Lock()
	defer r.mu.Unlock()
	f, _ := r.state.(*feedRun)
	return f
}

// feedPublishers are the publisher names of every feed scenario.
var feedPublishers = []string{"pub-a", "pub-b"}

// feedSetup is how a feed scenario's router and publishers reach their
// servers (see partitions.go).
type feedSetup struct {
	// routerNet: the router's feed (and budget) Redis client dials from
	// the run's "worker" network namespace.
	routerNet bool
	// publisherNet: the publishers run in the run's "publishers"
	// namespace.
	publisherNet bool
	// deployment, if set ("cluster", "sentinel"), puts the feed and the
	// budget on a Redis of that kind started for the scenario
	// (feedredis.go) instead of the suite's redis-server.
	deployment string
	// budget, if not 0, is a fleet budget of that many fallback reads a
	// second (burst the same) on the feed's Redis, through the router's
	// client.
	budget int
}

// configureFeed puts the router on a feed of its own, signed with a fresh
// key.
func configureFeed(r *run, c *consume.Config) error { return configureFeedWith(feedSetup{})(r, c) }

func configureFeedWith(setup feedSetup) func(r *run, c *consume.Config) error {
	return func(r *run, c *consume.Config) error {
		return setUpFeed(r, c, setup)
	}
}

func setUpFeed(r *run, c *consume.Config, setup feedSetup) error {
	k, err := feed.GenerateKey("chaos1")
	if err != nil {
		return err
	}
	f := &feedRun{name: r.s.name(r.sc.name), keys: feed.Keyring{Keys: []feed.Key{k}}, keyText: k.Export(), pubs: map[string]*publisherProc{}}
	opt := &redis.Options{Addr: r.s.redis.Addr(), DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second}
	if setup.routerNet {
		ns, err := r.namespace("worker")
		if err != nil {
			return err
		}
		opt.Dialer = ns.DialContext
	}
	if setup.publisherNet {
		if f.pubNS, err = r.namespace("publishers"); err != nil {
			return err
		}
	}
	prefix := "caughtup.budget." + f.name + "."
	if setup.deployment != "" {
		if f.deployment, err = startFeedDeployment(context.Background(), setup.deployment); err != nil {
			return err
		}
		r.closers = append(r.closers, func() { _ = f.deployment.close() })
		f.rdb = f.deployment.client()
		prefix = f.deployment.budgetPrefix(f.name)
	} else {
		f.rdb = redis.NewClient(opt)
	}
	r.closers = append(r.closers, func() { _ = f.rdb.Close() })
	// The subscriber's instruments and logs beside the router's.
	log := c.Logger
	if log == nil {
		log = r.s.log
	}
	src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: f.rdb, Feed: f.name, Keys: f.keys,
		Logger: log, MeterProvider: c.MeterProvider})
	if err != nil {
		return err
	}
	c.Tracker.Feed = &replay.FeedConfig{Source: src}
	if setup.budget > 0 {
		// The simulation's timeout (see chaos/fleet): a check answered late
		// on this loaded machine counts as unavailable.
		b, err := feed.NewBudget(feed.BudgetConfig{Client: f.rdb, Rate: setup.budget, Burst: setup.budget,
			Prefix: prefix, Timeout: 500 * time.Millisecond})
		if err != nil {
			return err
		}
		c.FleetBudget = b
	}
	r.mu.Lock()
	r.state = f
	r.mu.Unlock()
	return nil
}

// prepareFeed starts the observer and both publishers, and waits until
// the router takes every node from the feed.
func prepareFeed(ctx context.Context, r *run) error {
	f := feedOf(r)
	var err error
	if f.obs, err = startObserver(f.rdb, f.name, f.keys, r.s); err != nil {
		return err
	}
	r.closers = append(r.closers, f.obs.stop)
	r.closers = append(r.closers, f.killAll)
	var pids []string
	for _, name := range feedPublishers {
		p, err := f.startPublisher(ctx, r, name)
		if err != nil {
			return err
		}
		pids = append(pids, fmt.Sprintf("%s pid %d", name, p.pid()))
	}
	if err := f.waitOnFeed(ctx, r, 60*time.Second); err != nil {
		return err
	}
	f.mon = startFeedMonitor(r.env.router)
	f.switches0 = switches(r)
	r.closers = append(r.closers, f.mon.stop)
	r.event("feed %s: 2 publishers (caughtup feed processes: %s) poll every %s and sign with key %s; the router takes every node from the feed",
		f.name, strings.Join(pids, ", "), replay.DefaultFeedInterval, f.keys.Keys[0].ID)
	return nil
}

// startPublisher starts a `caughtup feed` process named name for the
// scenario's database and waits until the observer hears it.
func (f *feedRun) startPublisher(ctx context.Context, r *run, name string) (*publisherProc, error) {
	reps := map[string]string{}
	for _, n := range r.env.replicaNodes {
		reps[n.Name()] = n.DSN(r.env.name)
	}
	before := f.obs.seen(name)
	redisURL, redisMode := f.publisherRedis(r)
	p, err := r.s.feed.start(ctx, r.s.out, publisherArgs{
		name: name, feed: f.name, keys: f.keyText, redisURL: redisURL, redisMode: redisMode,
		primary: primaryDSN(r.cluster, r.env.name), replicas: reps, ns: f.pubNS,
	})
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.pubs[name] = p
	f.mu.Unlock()
	if err := f.obs.waitPublishing(ctx, p, before); err != nil {
		return nil, err
	}
	return p, nil
}

func (f *feedRun) publisher(name string) *publisherProc {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pubs[name]
}

func (f *feedRun) killAll() {
	f.mu.Lock()
	pubs := make([]*publisherProc, 0, len(f.pubs))
	for _, p := range f.pubs {
		pubs = append(pubs, p)
	}
	f.mu.Unlock()
	for _, p := range pubs {
		p.kill()
	}
}

// onFeed: the router takes every node from the feed.
func onFeed(router *consume.Router) bool {
	s := router.Tracker().Feed()
	return s.Active && s.LocalNodes == 0
}

func (f *feedRun) waitOnFeed(ctx context.Context, r *run, d time.Duration) error {
	if !waitFor(ctx, d, func() bool { return onFeed(r.env.router) }) {
		s := r.env.router.Tracker().Feed()
		return fmt.Errorf("the router did not take every node from the feed within %s (active %v, state %s, %d nodes polled locally)",
			d, s.Active, s.Health.State, s.LocalNodes)
	}
	return nil
}

// feedMonitor samples a router's feed status every 10ms: how long it
// polled every node itself (the feed not active), and how long some.
type feedMonitor struct {
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once

	allLocal, someLocal time.Duration
	start               time.Time
	fallbacks0          uint64
	fallbacks           uint64
}

func startFeedMonitor(router *consume.Router) *feedMonitor {
	ctx, cancel := context.WithCancel(context.Background())
	m := &feedMonitor{cancel: cancel, done: make(chan struct{}), start: time.Now(), fallbacks0: router.Tracker().Feed().Fallbacks}
	go func() {
		defer close(m.done)
		last := time.Now()
		for sleepCtx(ctx, 10*time.Millisecond) {
			s := router.Tracker().Feed()
			now := time.Now()
			switch {
			case !s.Active:
				m.allLocal += now.Sub(last)
			case s.LocalNodes > 0:
				m.someLocal += now.Sub(last)
			}
			m.fallbacks = s.Fallbacks - m.fallbacks0
			last = now
		}
	}()
	return m
}

func (m *feedMonitor) stop() {
	m.once.Do(func() {
		m.cancel()
		<-m.done
	})
}

// summary stops the monitor and describes what it saw.
func (m *feedMonitor) summary() string {
	m.stop()
	total := time.Since(m.start)
	return fmt.Sprintf("over %s the router polled every node itself for %s (feed not active) and some nodes for %s more; %d fallbacks (Router.Feed)",
		total.Round(100*time.Millisecond), m.allLocal.Round(10*time.Millisecond), m.someLocal.Round(10*time.Millisecond), m.fallbacks)
}

// pauser pauses replay on one replica, or on all of them one time in
// three, for random spells while production runs, so that a job whose
// router believed a position the replica does not have would read a stale
// row. hold stops it (once the current spell is over and every replica
// resumed) until release.
type pauser struct {
	gate   sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once

	spells   atomic.Int64
	replicaT atomic.Int64 // replica-nanoseconds paused
	errs     atomic.Int64
}

func startPauser(r *run, maxPause, maxGap time.Duration) *pauser {
	ctx, cancel := context.WithCancel(context.Background())
	p := &pauser{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		bg := context.Background()
		for ctx.Err() == nil {
			p.gate.Lock()
			var paused []*pgtest.Node
			for _, n := range r.cluster.Replicas() {
				if n.Running() {
					paused = append(paused, n)
				}
			}
			if len(paused) > 1 && rand.IntN(3) > 0 {
				i := rand.IntN(len(paused))
				paused = paused[i : i+1]
			}
			began := time.Now()
			for _, n := range paused {
				if err := n.PauseReplay(bg); err != nil {
					p.errs.Add(1)
				}
			}
			sleepCtx(ctx, maxPause/5+rand.N(maxPause*4/5+1))
			for _, n := range paused {
				if err := n.ResumeReplay(bg); err != nil {
					p.errs.Add(1)
				}
			}
			p.spells.Add(1)
			p.replicaT.Add(int64(time.Since(began)) * int64(len(paused)))
			p.gate.Unlock()
			sleepCtx(ctx, rand.N(maxGap+1))
		}
	}()
	return p
}

func (p *pauser) hold()    { p.gate.Lock() }
func (p *pauser) release() { p.gate.Unlock() }

func (p *pauser) stop() {
	p.once.Do(func() {
		p.cancel()
		<-p.done
	})
}

func (p *pauser) String() string {
	return fmt.Sprintf("%d random replay pauses, %.1f replica-seconds paused", p.spells.Load(), time.Duration(p.replicaT.Load()).Seconds())
}

// pauses are the random pauses' bounds for the scale: up to 1.5s paused,
// up to 1.5s between (shorter in the short run).
func pauses(sl scale) (maxPause, maxGap time.Duration) {
	if sl.jobs < fullScale.jobs {
		return 800 * time.Millisecond, 600 * time.Millisecond
	}
	return 1500 * time.Millisecond, 1500 * time.Millisecond
}

// runPauser starts the random pauses and stops them when the fault ends.
func runPauser(r *run) func() {
	f := feedOf(r)
	mp, mg := pauses(r.sl)
	f.pauser = startPauser(r, mp, mg)
	return func() {
		f.pauser.stop()
		r.event("random replay pauses ended: %s", f.pauser)
	}
}

// feedScenario is a scenario on the feed: the router configured and the
// publishers started by configureFeed and prepareFeed, the fault and
// checks given, and after them the checks every feed scenario shares.
func feedScenario(sc *scenario) *scenario { return feedScenarioWith(sc, feedSetup{}) }

// feedScenarioWith is feedScenario with the router and publishers set up
// as setup says.
func feedScenarioWith(sc *scenario, setup feedSetup) *scenario {
	sc.configure = configureFeedWith(setup)
	sc.prepare = prepareFeed
	check := sc.check
	sc.check = func(r *run, res *scenarioResult) {
		if check != nil {
			check(r, res)
		}
		checkFeedCommon(r, res)
		noteLostAsynq(r, res)
	}
	return sc
}

// switches are the router's caughtup.consume.feed.switches by
// "direction/<d>" and "state/<s>".
func switches(r *run) map[string]int64 {
	out := map[string]int64{}
	for k, v := range r.metrics.sum("caughtup.consume.feed.switches", "caughtup.feed.direction") {
		out["direction/"+k] = v
	}
	for k, v := range r.metrics.sum("caughtup.consume.feed.switches", "caughtup.feed.state") {
		out["state/"+k] = v
	}
	return out
}

// checkFeedCommon: replay pauses made jobs wait or defer (else staleness
// could not show), the router is back on the feed by the end, and the
// notes say how it used the feed and what it rejected.
func checkFeedCommon(r *run, res *scenarioResult) {
	f := feedOf(r)
	if f == nil || f.mon == nil {
		return // the scenario did not get as far as the feed; it failed already
	}
	all := res.Streams[len(res.Streams)-1]
	// Under sticky, promotions and the cap's refusals show it as well.
	if waited := all.Outcomes[consume.OutcomeReplicaWaited.String()]; all.Deferrals == 0 && waited == 0 && all.Fallbacks == 0 && all.Capped == 0 {
		r.fail("no job waited for a replica, was deferred or was promoted: the replay pauses did not take effect")
	}
	if !waitFor(context.Background(), 30*time.Second, func() bool { return onFeed(r.env.router) }) {
		s := r.env.router.Tracker().Feed()
		r.fail("the router was not back on the feed at the end (active %v, state %s, %d nodes polled locally)", s.Active, s.Health.State, s.LocalNodes)
	}
	r.note("feed: %s", f.mon.summary())
	if f.pauser != nil {
		r.note("%s", f.pauser)
	}
	r.note("caughtup.consume.feed.switches once the router was on the feed: %s", sortedCounts(delta(switches(r), f.switches0)))
	if f.forged == nil {
		rej := r.metrics.sum("caughtup.feed.rejected", "caughtup.reason")
		obsRej := r.metrics.sum("caughtup.consume.feed.observations.rejected", "caughtup.reason")
		r.note("messages rejected by the feed: %v; observations the router did not believe: %v", sortedCounts(rej), sortedCounts(obsRej))
	}
	var heard []string
	for _, name := range feedPublishers {
		s := f.obs.seen(name)
		heard = append(heard, fmt.Sprintf("%s %d (%d late, oldest %s)", name, s.count, s.late, s.maxAge.Round(time.Millisecond)))
	}
	r.note("observations the suite's own subscriber received, by publisher: %s", strings.Join(heard, "; "))
}

func sortedCounts(m map[string]int64) string {
	keys := make([]string, 0, len(m))
	for k, v := range m {
		if v != 0 {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var b strings.Builder
	b.WriteString("{")
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s: %d", k, m[k])
	}
	b.WriteString("}")
	return b.String()
}

// ---- the scenarios ----

func feedPublisherKillScenario(sl scale) *scenario {
	return feedScenario(&scenario{
		name: "feed-publisher-kill",
		about: "router on a signed feed of 2 publisher processes, random replay pauses; pub-a SIGKILLed mid-run, " +
			"pub-b keeps the feed going",
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + 2*s.down + s.tail) },
		fault:  feedPublisherKill,
		check:  checkPublisherKill,
	})
}

func feedPublisherKill(ctx context.Context, r *run) error {
	f := feedOf(r)
	defer runPauser(r)()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	victim := f.publisher("pub-a")
	if err := victim.terminate(syscall.SIGKILL); err != nil {
		return err
	}
	killed := time.Now()
	r.event("SIGKILLed pub-a (pid %d); pub-b keeps publishing", victim.pid())
	a0, b0 := f.obs.seen("pub-a").count, f.obs.seen("pub-b").count
	if err := r.at(ctx, r.sl.lead+2*r.sl.down); err != nil {
		return err
	}
	a1, b1 := f.obs.seen("pub-a").count, f.obs.seen("pub-b").count
	f.mu.Lock()
	f.killedHeard, f.survivorHeard = a1-a0, b1-b0
	f.mu.Unlock()
	r.event("in the %s after the kill: %d observations from pub-a, %d from pub-b", time.Since(killed).Round(100*time.Millisecond), a1-a0, b1-b0)
	return nil
}

func checkPublisherKill(r *run, res *scenarioResult) {
	f := feedOf(r)
	if f == nil {
		return
	}
	f.mu.Lock()
	killed, survivor := f.killedHeard, f.survivorHeard
	f.mu.Unlock()
	// A few of pub-a's last messages may still be in flight at the kill.
	if killed > 10 {
		r.fail("%d observations from pub-a after its SIGKILL: the kill did not take effect", killed)
	}
	if survivor == 0 {
		r.fail("no observation from pub-b after pub-a was killed: the feed was not kept going")
	}
}

func feedPublishersStoppedScenario(sl scale) *scenario {
	return feedScenario(&scenario{
		name: "feed-publishers-stopped",
		about: fmt.Sprintf("router on a signed feed of 2 publisher processes, random replay pauses; both publishers stopped (SIGTERM) for %s: "+
			"the router falls back to its own polls, then returns to the feed when they start again", sl.down),
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + s.down + 2*s.tail) },
		fault:  feedPublishersStopped,
		check:  checkFallbackCounted("silent"),
	})
}

func feedPublishersStopped(ctx context.Context, r *run) error {
	f := feedOf(r)
	defer runPauser(r)()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	for _, name := range feedPublishers {
		if err := f.publisher(name).terminate(syscall.SIGTERM); err != nil {
			return err
		}
	}
	stopped := time.Now()
	r.event("stopped both publishers (SIGTERM)")
	if !waitFor(ctx, 15*time.Second, func() bool { return !r.env.router.Tracker().Feed().Active }) {
		return fmt.Errorf("the router did not fall back within 15s of the publishers stopping")
	}
	st := r.env.router.Tracker().Feed()
	r.event("the router fell back to its own polls %s after the stop (feed %s, %d nodes polled locally)",
		time.Since(stopped).Round(time.Millisecond), st.Health.State, st.LocalNodes)
	if err := r.at(ctx, r.sl.lead+r.sl.down); err != nil {
		return err
	}
	restarted := time.Now()
	for _, name := range feedPublishers {
		if _, err := f.startPublisher(ctx, r, name); err != nil {
			return err
		}
	}
	if err := f.waitOnFeed(ctx, r, 30*time.Second); err != nil {
		return err
	}
	r.event("started both publishers again; the router took every node from the feed %s later", time.Since(restarted).Round(time.Millisecond))
	return nil
}

// checkFallbackCounted: the router's fallback to its own polls was
// counted (caughtup.consume.feed.switches to_local, in one of states),
// and so was its return.
func checkFallbackCounted(states ...string) func(r *run, res *scenarioResult) {
	return func(r *run, res *scenarioResult) {
		f := feedOf(r)
		if f == nil || f.mon == nil {
			return
		}
		sw := delta(switches(r), f.switches0)
		var in int64
		for _, s := range states {
			in += sw["state/"+s]
		}
		if sw["direction/to_local"] == 0 || in == 0 {
			r.fail("the fallback to local polling was not counted: switches to_local %d, in state %s %d", sw["direction/to_local"], strings.Join(states, " or "), in)
		}
		if sw["direction/to_feed"] == 0 {
			r.fail("the return to the feed was not counted (switches to_feed 0)")
		}
		if r.env.router.Tracker().Feed().Fallbacks == f.mon.fallbacks0 {
			r.fail("Router.Tracker().Feed().Fallbacks did not grow with the fallback")
		}
	}
}

func feedRedisRestartScenario(sl scale) *scenario {
	return feedScenario(&scenario{
		name: "feed-redis-restart",
		about: fmt.Sprintf("router on a signed feed of 2 publisher processes; redis-server (feed, asynq queues) stopped for %s and started again, "+
			"replay paused from %s before the stop until Redis is back: the router polls by itself meanwhile, then returns to the feed",
			sl.redisDown, redisPrePause),
		policy: consume.Delayed,
		// As redis-restart: no attempt may end while Redis is down.
		router: func(c *consume.Config) { c.WaitBudget = redisPrePause + sl.redisDown + 3*time.Second },
		span: func(s scale) time.Duration {
			return s.span(s.lead + redisPrePause + s.redisDown + 2*s.tail)
		},
		fault: func(ctx context.Context, r *run) error {
			if err := redisRestart(ctx, r); err != nil {
				return err
			}
			back := time.Now()
			if err := feedOf(r).waitOnFeed(ctx, r, 30*time.Second); err != nil {
				return err
			}
			r.event("the router took every node from the feed again %s after replay resumed", time.Since(back).Round(time.Millisecond))
			return nil
		},
		check: func(r *run, res *scenarioResult) {
			checkRedis(r, res)
			checkFallbackCounted("unreachable", "dropped", "silent")(r, res)
		},
	})
}

// sigstopPlan is one SIGSTOP of some publishers for a while.
type sigstopPlan struct {
	who []string
	d   time.Duration
}

// sigstopPlans: pub-a alone (pub-b keeps the feed), both at once (the
// router falls back to its own polls, then returns). pub-a is frozen in
// the middle of a poll of the primary, which it publishes after the
// freeze, that much late (its values, or past the publisher's query
// timeout of 1s, possibly the poll's failure). The short run keeps one of
// each kind.
func sigstopPlans(sl scale) []sigstopPlan {
	a := []string{"pub-a"}
	if sl.jobs < fullScale.jobs {
		return []sigstopPlan{{a, 500 * time.Millisecond}, {feedPublishers, 1500 * time.Millisecond}, {a, 6 * time.Second}, {a, 800 * time.Millisecond}}
	}
	return []sigstopPlan{{a, 500 * time.Millisecond}, {a, 3 * time.Second}, {feedPublishers, 2 * time.Second},
		{a, 800 * time.Millisecond}, {a, 7 * time.Second}, {feedPublishers, 900 * time.Millisecond}}
}

func sigstopSpan(sl scale) time.Duration {
	var t time.Duration
	for _, p := range sigstopPlans(sl) {
		t += p.d + sl.tail/2
	}
	return t
}

func feedPublisherSigstopScenario(sl scale) *scenario {
	var plan []string
	for _, p := range sigstopPlans(sl) {
		plan = append(plan, fmt.Sprintf("%s for %s", strings.Join(p.who, "+"), p.d))
	}
	return feedScenario(&scenario{
		name: "feed-publisher-sigstop",
		about: "router on a signed feed of 2 publisher processes, random replay pauses; publishers frozen with SIGSTOP (" + strings.Join(plan, ", ") +
			"), pub-a in the middle of a poll of the primary, so that the observation it was making arrives that late",
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + sigstopSpan(s) + s.tail) },
		fault:  feedPublisherSigstop,
		check: func(r *run, res *scenarioResult) {
			f := feedOf(r)
			if f == nil || f.mon == nil {
				return
			}
			f.mu.Lock()
			late, stops := f.late, f.stops
			f.mu.Unlock()
			r.note("%d SIGSTOPs; %d observations from stopped publishers arrived more than %s after their poll started (oldest %s)",
				stops, late.late, lateAge, late.maxAge.Round(time.Millisecond))
			if late.late == 0 {
				r.fail("no observation arrived late after %d SIGSTOPs in the middle of a poll: the delay did not take effect", stops)
			}
		},
	})
}

func feedPublisherSigstop(ctx context.Context, r *run) error {
	f := feedOf(r)
	defer runPauser(r)()
	t := r.sl.lead
	if err := r.at(ctx, t); err != nil {
		return err
	}
	lateOf := func() publisherSeen {
		var s publisherSeen
		for _, name := range feedPublishers {
			p := f.obs.seen(name)
			s.late += p.late
			s.maxAge = max(s.maxAge, p.maxAge)
		}
		return s
	}
	before := lateOf()
	// pub-a is frozen in the middle of a poll of the primary, so that what
	// it read before the stop is published after it; the others simply.
	// (A replica's observation is stamped with the time its answer was
	// read, which a poll frozen in flight moves past the freeze: still a
	// lower bound of the replica's position then. The primary's carries
	// the time its query was sent.)
	stop := func(who []string, d time.Duration) error {
		var procs []*publisherProc
		for _, name := range who {
			procs = append(procs, f.publisher(name))
		}
		err := freezeMidPoll(ctx, r, procs[0], r.cluster.Primary(), d, procs[1:])
		f.mu.Lock()
		f.stops++
		f.mu.Unlock()
		return err
	}
	for _, p := range sigstopPlans(r.sl) {
		l0 := lateOf()
		if err := stop(p.who, p.d); err != nil {
			return err
		}
		// The late messages come at once; a moment for them to arrive.
		sleepCtx(ctx, 200*time.Millisecond)
		l1 := lateOf()
		r.event("SIGSTOPped %s for %s, then SIGCONT: %d observations arrived late (oldest %s); router: %s",
			strings.Join(p.who, "+"), p.d, l1.late-l0.late, l1.maxAge.Round(time.Millisecond), feedState(r.env.router))
		t += p.d + r.sl.tail/2
		if err := r.at(ctx, t); err != nil {
			return err
		}
	}
	l := lateOf()
	f.mu.Lock()
	f.late = publisherSeen{late: l.late - before.late, maxAge: l.maxAge}
	f.mu.Unlock()
	return nil
}

// freezeMidPoll SIGSTOPs p while one of its polls of node is in flight,
// and others with it, for d: the backends serving p's connections to node
// are SIGSTOPped first, so that p's next poll of node waits for its answer;
// then p and others are stopped and the backends continued, so that the
// answer waits in p's socket. When p continues after d it reads that
// answer and publishes an observation it has held for about d, as a
// publisher stalled between its poll and its send would.
func freezeMidPoll(ctx context.Context, r *run, p *publisherProc, node *pgtest.Node, d time.Duration, others []*publisherProc) error {
	ports, err := p.clientPorts(node.Port())
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, node.DSN(r.env.name))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE client_port = ANY($1::int[])`, ports)
	if err != nil {
		return err
	}
	backends, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return err
	}
	if len(backends) == 0 {
		return fmt.Errorf("no backend of publisher %s on %s (client ports %v)", p.name, node.Name(), ports)
	}
	cont := func() {
		for _, pid := range backends {
			_ = syscall.Kill(int(pid), syscall.SIGCONT)
		}
	}
	defer cont()
	for _, pid := range backends {
		if err := syscall.Kill(int(pid), syscall.SIGSTOP); err != nil {
			return fmt.Errorf("SIGSTOP backend %d on %s: %w", pid, node.Name(), err)
		}
	}
	// A few rounds: the next poll of node is sent, and waits.
	sleepCtx(ctx, 3*replay.DefaultFeedInterval)
	all := append([]*publisherProc{p}, others...)
	for _, q := range all {
		if err := q.signal(syscall.SIGSTOP); err != nil {
			return err
		}
	}
	cont()
	sleepCtx(ctx, d)
	for _, q := range all {
		if err := q.signal(syscall.SIGCONT); err != nil {
			return err
		}
	}
	return nil
}

func feedState(router *consume.Router) string {
	s := router.Tracker().Feed()
	if s.Active {
		return fmt.Sprintf("on the feed, %d nodes polled locally", s.LocalNodes)
	}
	return fmt.Sprintf("polling every node itself (feed %s)", s.Health.State)
}

func feedFailoverScenario(sl scale) *scenario {
	return feedScenario(&scenario{
		name: "feed-failover",
		about: "router on a signed feed of 2 publisher processes, random replay pauses; replica1 promoted mid-run on a cluster of its own " +
			"(timeline 1 -> 2); publishers and router follow the primary through a multi-host read-write URL; 40% of jobs enqueued 0.2-3s after their write",
		fresh:  true,
		policy: consume.Delayed,
		delay:  lateEnqueue,
		span:   func(s scale) time.Duration { return s.span(s.lead + 2*s.down + s.tail) },
		fault: func(ctx context.Context, r *run) error {
			f := feedOf(r)
			defer runPauser(r)()
			if err := r.at(ctx, r.sl.lead); err != nil {
				return err
			}
			// No replay pause across the promotion itself.
			f.pauser.hold()
			err := failover(ctx, r)
			f.pauser.release()
			if err != nil {
				return err
			}
			back := time.Now()
			if err := f.waitOnFeed(ctx, r, 30*time.Second); err != nil {
				return err
			}
			r.event("router on the feed for every node after the promotion (%s after the tracker saw it): %s",
				time.Since(back).Round(time.Millisecond), feedState(r.env.router))
			return nil
		},
		check: checkFailover,
	})
}

// noteLostAsynq says where the asynq jobs that never completed are in
// Redis (their state, retries, next run, last error), or that they are
// in no state at all, for whoever reads a failed run.
func noteLostAsynq(r *run, res *scenarioResult) {
	if len(res.Streams) == 0 || res.Streams[0].Stream != "asynq" || res.Streams[0].Lost == 0 {
		return
	}
	lost := map[int64]bool{}
	r.ast.mu.Lock()
	for id := range r.ast.produced {
		if _, ok := r.ast.completed[id]; !ok {
			lost[id] = true
		}
	}
	r.ast.mu.Unlock()
	insp := asynq.NewInspector(r.s.redisOpt())
	defer insp.Close()
	var found []string
	for _, list := range []func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error){
		insp.ListPendingTasks, insp.ListActiveTasks, insp.ListScheduledTasks, insp.ListRetryTasks, insp.ListArchivedTasks,
	} {
		for page := 1; ; page++ {
			tasks, err := list(r.queue, asynq.Page(page), asynq.PageSize(1000))
			if err != nil || len(tasks) == 0 {
				break
			}
			for _, t := range tasks {
				if p, err := decodePayload(t.Payload); err == nil && lost[p.ID] {
					delete(lost, p.ID)
					found = append(found, fmt.Sprintf("job %d: %s, retried %d, next %s, orphaned %v, last error %q",
						p.ID, t.State, t.Retried, t.NextProcessAt.Format("15:04:05.000"), t.IsOrphaned, t.LastErr))
				}
			}
		}
	}
	for id := range lost {
		found = append(found, fmt.Sprintf("job %d: in no state of queue %s", id, r.queue))
	}
	sort.Strings(found)
	r.note("asynq jobs that never completed, as Redis has them: %s", strings.Join(found, "; "))
}
