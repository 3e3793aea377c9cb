package consume

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Integration tests of the feed: the real cluster, a real redis-server,
// the consume replay.Publisher and Routers on its feed. Waits are on conditions
// with generous deadlines; nothing asserts on time.

// feedDeadline bounds every wait for a condition.
const feedDeadline = 30 * time.Second

var feedSeq atomic.Int64

// fleetEnv is one test's feed on a cluster: its Redis, a unique feed
// name, a key, and the MeterProvider its routers record to.
type fleetEnv struct {
	*env
	rdb    *redis.Client
	name   string
	keys   feed.Keyring
	reader *sdkmetric.ManualReader
	mp     *sdkmetric.MeterProvider
}

func newFleetEnv(t *testing.T, c *pgtest.Cluster, redisAddr string) *fleetEnv {
	t.Helper()
	if redisAddr == "" {
		redisAddr = pgtest.SharedRedis(t).Addr()
	}
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr, DialTimeout: time.Second, ReadTimeout: time.Second, MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	k, err := feed.GenerateKey("k1")
	require.NoError(t, err)
	name := strings.Map(func(r rune) rune {
		if 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' {
			return r
		}
		return '-'
	}, t.Name())
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return &fleetEnv{env: setup(t, c), rdb: rdb, name: fmt.Sprintf("%.40s.%d", name, feedSeq.Add(1)),
		keys: feed.Keyring{Keys: []feed.Key{k}}, reader: reader, mp: mp}
}

// databases is the cluster's replicas named r1, r2, … as routers name them.
func (f *fleetEnv) databases() map[string]replay.Database {
	reps := make([]replay.Replica, len(f.replicas))
	for i, p := range f.replicas {
		reps[i] = replay.Replica{Name: fmt.Sprintf("r%d", i+1), Pool: p}
	}
	return map[string]replay.Database{"main": {Primary: f.primary, Replicas: reps}}
}

// publisher starts a replay.Publisher of the test's feed, closed at cleanup.
func (f *fleetEnv) publisher(t *testing.T, name string, mods ...func(*replay.PublisherConfig)) *replay.Publisher {
	t.Helper()
	return f.publisherOf(t, name, f.databases(), mods...)
}

// publisherOf is publisher for the databases dbs.
func (f *fleetEnv) publisherOf(t *testing.T, name string, dbs map[string]replay.Database, mods ...func(*replay.PublisherConfig)) *replay.Publisher {
	t.Helper()
	cfg := replay.PublisherConfig{
		Feed:   feed.SenderConfig{Client: f.rdb, Feed: f.name, Name: name, Keys: f.keys},
		Logger: testLogger(t),
	}
	for _, m := range mods {
		m(&cfg)
	}
	p, err := replay.NewPublisher(ctxT(t), dbs, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// feedRouter is a Router on the test's feed.
func (f *fleetEnv) feedRouter(t *testing.T, mods ...func(*Config)) *Router {
	t.Helper()
	return f.router(t, append([]func(*Config){func(c *Config) {
		c.Databases = f.databases()
		c.MeterProvider = f.mp
		c.Tracker.Feed = &replay.FeedConfig{Client: f.rdb, Name: f.name, Keys: f.keys}
	}}, mods...)...)
}

// waitOnFeed waits until r takes every node from the feed.
func waitOnFeed(t *testing.T, r *Router) {
	t.Helper()
	require.Eventually(t, func() bool {
		s := r.Tracker().Feed()
		return s.Active && s.LocalNodes == 0
	}, feedDeadline, time.Millisecond, "router never took every node from the feed")
}

// waitOffFeed waits until r polls every node itself.
func waitOffFeed(t *testing.T, r *Router) {
	t.Helper()
	n := 0
	for _, db := range r.Snapshot().Databases {
		n += 1 + len(db.Replicas)
	}
	require.Eventually(t, func() bool {
		s := r.Tracker().Feed()
		return !s.Active && s.LocalNodes == n
	}, feedDeadline, time.Millisecond, "router never fell back to its own polls")
}

func (f *fleetEnv) switches(t *testing.T, direction, state string) int64 {
	t.Helper()
	return metrictest.Sum(t, f.reader, "caughtup.consume.feed.switches",
		attribute.String("caughtup.feed.direction", direction), attribute.String("caughtup.feed.state", state))
}

func (f *fleetEnv) metric(t *testing.T, name string, kv ...attribute.KeyValue) int64 {
	t.Helper()
	return metrictest.Sum(t, f.reader, name, kv...)
}

// record subscribes to the feed's channel with a plain Redis client and
// returns the next n messages as sent, to replay or inspect.
func (f *fleetEnv) record(t *testing.T, n int) [][]byte {
	t.Helper()
	ctx := ctxT(t)
	spy := f.rdb.Subscribe(ctx, feed.ChannelName(f.name))
	defer spy.Close()
	var got [][]byte
	for len(got) < n {
		m, err := spy.ReceiveMessage(ctx)
		require.NoError(t, err)
		got = append(got, []byte(m.Payload))
	}
	require.NoError(t, spy.Close())
	return got
}

// backgroundJobs routes a Sticky job for one token over and over while a
// test injects faults.
type backgroundJobs struct {
	routed, failed atomic.Int64
	// stale counts jobs routed to a replica that must not serve the
	// token, or given a pool that lacks the token's row.
	stale atomic.Int64
	stop  func() // ends the loop and waits for it; idempotent
}

// routeInBackground routes a Sticky job for tok, which wrote row id, in a
// loop until stop is called or the test ends; lacking(name) says whether
// the replica name lacks the row.
func routeInBackground(t *testing.T, r *Router, tok position.Token, id int64, lacking func(replica string) bool) *backgroundJobs {
	t.Helper()
	j := &backgroundJobs{}
	quit := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-quit:
				return
			default:
			}
			hctx, d, err := r.Route(context.Background(), Job{Token: tok, Policy: Sticky})
			if err != nil {
				if j.failed.Add(1) == 1 {
					t.Logf("route: %v", err)
				}
				continue
			}
			j.routed.Add(1)
			var n int
			if lacking(d.Databases[0].Replica) ||
				DB(hctx, "main").QueryRow(context.Background(), "SELECT count(*) FROM items WHERE id = $1", id).Scan(&n) != nil || n != 1 {
				j.stale.Add(1)
			}
		}
	})
	j.stop = sync.OnceFunc(func() { close(quit); wg.Wait() })
	t.Cleanup(j.stop)
	return j
}

// jobRead routes a job for tok, retrying deferrals at once (a queue would
// later), and reports whether the pool it was given has the row: false is
// a stale read.
func jobRead(t *testing.T, r *Router, policy Policy, tok position.Token, id int64) (Decision, bool) {
	t.Helper()
	for {
		hctx, d, err := r.Route(ctxT(t), Job{Token: tok, Policy: policy})
		if err != nil {
			require.ErrorIs(t, err, ErrDeferred)
			continue
		}
		return d, found(t, DB(hctx, "main"), id)
	}
}

// TestFeedRoutesWithoutStaleReads routes jobs on the feed while replay
// pauses and resumes at random: every job that runs reads its row.
func TestFeedRoutesWithoutStaleReads(t *testing.T) {
	c := pgtest.Shared(t)
	f := newFleetEnv(t, c, "")
	f.publisher(t, "pub-a")
	f.publisher(t, "pub-b")
	r := f.feedRouter(t, func(c *Config) { c.WaitBudget = 50 * time.Millisecond })
	waitOnFeed(t, r)
	// On the feed the router holds no connection to any node.
	require.Eventually(t, func() bool {
		n := 0
		for _, st := range r.Tracker().Stat() {
			n += st.Conns
		}
		return n == 0
	}, feedDeadline, time.Millisecond)

	ctx, stop := context.WithCancel(ctxT(t))
	var lag sync.WaitGroup
	lag.Go(func() { c.PauseRandomly(ctx, 150*time.Millisecond, 100*time.Millisecond, t.Logf) })
	defer func() { stop(); lag.Wait() }()

	var replica, primary int
	for i := range 300 {
		id, tok := f.write(t)
		policy := Delayed
		if i%3 == 0 {
			policy = Sticky
		}
		d, ok := jobRead(t, r, policy, tok, id)
		require.True(t, ok, "job %d read stale data: %+v", i, d)
		if d.Databases[0].Replica != "" {
			replica++
		} else {
			primary++
		}
	}
	t.Logf("300 jobs under random replay pauses on the feed: %d on a replica, %d on the primary, 0 stale; feed %+v",
		replica, primary, r.Tracker().Feed())
	require.Positive(t, replica, "the feed let jobs use the replicas")
}

// TestFeedWakesWaitingJobs: a job waiting for a paused replica wakes on a
// feed message once replay resumes, and its wait does not make the router
// poll: the publishers set the pace.
func TestFeedWakesWaitingJobs(t *testing.T) {
	c := pgtest.Shared(t)
	f := newFleetEnv(t, c, "")
	f.publisher(t, "pub-a")
	r := f.feedRouter(t, func(c *Config) { c.WaitBudget = 20 * time.Second })
	waitOnFeed(t, r)
	pauseAll(t, c)
	id, tok := f.write(t)

	type result struct {
		hctx context.Context
		d    Decision
		err  error
	}
	done := make(chan result, 1)
	go func() {
		hctx, d, err := r.Route(context.Background(), Job{Token: tok, Policy: Delayed})
		done <- result{hctx, d, err}
	}()
	require.Eventually(t, func() bool { return watchers(r, 0) > 0 }, feedDeadline, time.Millisecond)
	before, q0 := r.Tracker().Feed(), replicaQueries(r)
	seq0 := r.Snapshot().Seq
	// Feed messages keep arriving while it waits.
	require.Eventually(t, func() bool { return r.Snapshot().Seq > seq0+10 }, feedDeadline, time.Millisecond)
	resumeAll(t, c)
	var res result
	select {
	case res = <-done:
	case <-time.After(feedDeadline):
		t.Fatal("the job still waits after replay resumed")
	}
	require.NoError(t, res.err)
	require.Equal(t, OutcomeReplicaWaited, res.d.Outcome)
	require.True(t, found(t, DB(res.hctx, "main"), id), "the replica it woke for has the row")
	after, q1 := r.Tracker().Feed(), replicaQueries(r)
	if after.Fallbacks == before.Fallbacks && after.Active {
		// On the feed throughout: the wait cost the replicas nothing.
		require.Equal(t, q0, q1, "the router queried the replicas while on the feed")
	} else {
		t.Logf("the router fell back during the wait (%+v → %+v); its queries are not checked", before, after)
	}
}

// TestFeedFallbackAndBack: silence (every publisher stopped), a dropped
// subscription and a Redis restart each send the router to its own polls,
// which keep routing right, and it returns to the feed when the feed
// recovers. Each switch is counted.
func TestFeedFallbackAndBack(t *testing.T) {
	t.Parallel()
	rs, err := pgtest.StartRedis(ctxT(t))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, rs.Close()) })
	f := newFleetEnv(t, pgtest.Shared(t), rs.Addr())
	pub := f.publisher(t, "pub-a")
	r := f.feedRouter(t)
	waitOnFeed(t, r)
	require.EqualValues(t, 1, f.switches(t, "to_feed", "subscribed"))

	routesRight := func(what string) {
		t.Helper()
		id, tok := f.write(t)
		seen(t, r, tok)
		d, ok := jobRead(t, r, Sticky, tok, id)
		require.True(t, ok, "%s: stale read %+v", what, d)
		require.NotEmpty(t, d.Databases[0].Replica, "%s: the router's own polls serve replicas", what)
	}
	routesRight("on the feed")

	// Every publisher stops: the feed falls silent.
	require.NoError(t, pub.Close())
	waitOffFeed(t, r)
	// Nodes go to local polls on their own silence bound; the switch of
	// the whole feed follows when the subscriber reports the silence.
	require.Eventually(t, func() bool { return f.switches(t, "to_local", "silent") == 1 }, feedDeadline, time.Millisecond)
	routesRight("feed silent")
	pub = f.publisher(t, "pub-b")
	require.Eventually(t, func() bool { return f.switches(t, "to_feed", "subscribed") == 2 }, feedDeadline, time.Millisecond)
	waitOnFeed(t, r)
	routesRight("feed back")

	// The subscription is dropped by the server.
	require.NoError(t, f.rdb.Do(ctxT(t), "CLIENT", "KILL", "TYPE", "pubsub").Err())
	require.Eventually(t, func() bool { return f.switches(t, "to_local", "dropped") == 1 }, feedDeadline, time.Millisecond)
	require.Eventually(t, func() bool { return f.switches(t, "to_feed", "subscribed") == 3 }, feedDeadline, time.Millisecond)
	waitOnFeed(t, r)

	// Redis stops: the router polls by itself, and the fleet budget is
	// not consulted either; it comes back when Redis does.
	require.NoError(t, rs.Stop())
	waitOffFeed(t, r)
	routesRight("Redis down")
	require.NoError(t, rs.Start(ctxT(t)))
	require.Eventually(t, func() bool { return f.switches(t, "to_feed", "subscribed") == 4 }, feedDeadline, time.Millisecond)
	waitOnFeed(t, r)
	routesRight("Redis back")
	// Every switch away from the feed was followed by one back.
	toLocal := f.metric(t, "caughtup.consume.feed.switches", attribute.String("caughtup.feed.direction", "to_local"))
	require.EqualValues(t, 3, toLocal)
	require.EqualValues(t, 1, f.switches(t, "to_local", "silent"))
	_ = pub
}

// TestFeedRejectsForgedUnsignedReplayedImpossible injects messages with
// plain Redis clients while replay is paused and jobs are routed: none of
// them changes a decision, and each is counted by its reason.
func TestFeedRejectsForgedUnsignedReplayedImpossible(t *testing.T) {
	c := pgtest.Shared(t)
	f := newFleetEnv(t, c, "")
	f.publisher(t, "pub-a")
	r := f.feedRouter(t, func(c *Config) { c.PrimaryRate = rate.Inf })
	waitOnFeed(t, r)

	// Capture authentic messages with a plain subscriber, to replay.
	ctx := ctxT(t)
	captured := f.record(t, 5)

	pauseAll(t, c)
	id, tok := f.write(t)
	claim := tok.Entries[0].LSN + 1<<20 // "caught up", and more
	snap := r.Snapshot().Database("main")
	incs := make([]replay.Incarnation, len(snap.Replicas))
	for i, rs := range snap.Replicas {
		incs[i] = rs.Incarnation
	}
	epoch := tok.Entries[0].Epoch
	claims := func(pub *feed.Sender, n int, inc func(i int) replay.Incarnation) {
		for range n {
			for i := range incs {
				in := inc(i)
				require.NoError(t, pub.Publish(feed.Observation{Database: "main", Node: fmt.Sprintf("r%d", i+1), Role: feed.RoleReplica,
					Replica: feed.ReplicaStatus{InRecovery: true, Replayed: claim, Epoch: epoch,
						Incarnation: in.PostmasterStart, RecoveryStart: in.RecoveryStart}}))
				require.NoError(t, pub.Flush(ctx))
			}
		}
	}
	attacker := func(keys feed.Keyring, insecure bool) *feed.Sender {
		// TTL 1ms: their stored values are gone before any resubscription
		// could read them again.
		p, err := feed.NewSender(feed.SenderConfig{Client: f.rdb, Feed: f.name, Name: "attacker", Keys: keys,
			Insecure: insecure, TTL: time.Millisecond, Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		return p
	}
	wrongSecret, err := feed.GenerateKey("k1")
	require.NoError(t, err)
	otherKey, err := feed.GenerateKey("k9")
	require.NoError(t, err)
	current := func(i int) replay.Incarnation { return incs[i] }

	// Jobs keep being routed while the messages arrive; the token is past
	// every paused replica, so a replica read would be stale.
	jobs := routeInBackground(t, r, tok, id, func(replica string) bool { return replica != "" })
	defer jobs.stop()

	const n = 10
	claims(attacker(feed.Keyring{Keys: []feed.Key{wrongSecret}}, false), n, current) // forged: bad signature
	claims(attacker(feed.Keyring{Keys: []feed.Key{otherKey}}, false), n, current)    // a key the router lacks
	claims(attacker(feed.Keyring{}, true), n, current)                               // unsigned
	for _, b := range captured {                                                     // replayed
		require.NoError(t, f.rdb.Publish(ctx, feed.ChannelName(f.name), b).Err())
	}
	for range n { // garbage
		require.NoError(t, f.rdb.Publish(ctx, feed.ChannelName(f.name), "\x01FFFFFFFF/FFFFFFFF").Err())
	}
	// Authentic but impossible: past the primary's insert position.
	claims(attacker(f.keys, false), n, current)
	// Authentic, of an earlier run of each replica: superseded.
	claims(attacker(f.keys, false), n, func(i int) replay.Incarnation {
		in := incs[i]
		in.PostmasterStart = in.PostmasterStart.Add(-time.Hour)
		return in
	})

	rejected := func(reason string) int64 {
		return metrictest.Sum(t, f.reader, "caughtup.feed.rejected", attribute.String("caughtup.reason", reason))
	}
	want := map[string]int64{"bad_signature": 2 * n, "unknown_key": 2 * n, "unsigned": 2 * n, "replayed": int64(len(captured)), "malformed": n}
	superseded := func() int64 {
		return f.metric(t, "caughtup.consume.feed.observations.rejected", attribute.String(attrReason, "superseded"))
	}
	require.Eventually(t, func() bool {
		for reason, w := range want {
			if rejected(reason) < w {
				return false
			}
		}
		return superseded() >= 2*n
	}, feedDeadline, time.Millisecond, func() string {
		got := map[string]int64{"superseded": superseded()}
		for reason := range want {
			got[reason] = rejected(reason)
		}
		return fmt.Sprintf("rejections %v, want %v and superseded %d", got, want, 2*n)
	}())
	for reason, w := range want {
		require.Equal(t, w, rejected(reason), reason)
	}
	// The impossible claims were held, then found impossible (or dropped
	// unverified): none was merged as a position.
	impossible := f.metric(t, "caughtup.consume.tracker.observations.rejected", attribute.String(attrReason, "impossible"))
	unverified := f.metric(t, "caughtup.consume.feed.observations.rejected", attribute.String(attrReason, "unverified"))
	require.Eventually(t, func() bool {
		impossible = f.metric(t, "caughtup.consume.tracker.observations.rejected", attribute.String(attrReason, "impossible"))
		unverified = f.metric(t, "caughtup.consume.feed.observations.rejected", attribute.String(attrReason, "unverified"))
		return impossible+unverified >= 2*n
	}, feedDeadline, time.Millisecond)
	jobs.stop()
	require.Zero(t, jobs.stale.Load(), "a job was routed to a replica that lacks its row")
	require.Positive(t, jobs.routed.Load())
	for _, rs := range r.Snapshot().Database("main").Replicas {
		require.Less(t, rs.HighestReplayed, tok.Entries[0].LSN, "replica %s was believed past its paused position", rs.Name)
	}
	t.Logf("%d jobs routed during the injection (%d refused), 0 on a replica; impossible %d, unverified %d", jobs.routed.Load(), jobs.failed.Load(), impossible, unverified)
}

// TestFeedOldRunAndSwappedNamesNotBelieved: after a replica restarts, an
// authentic message of its earlier run (recorded before the restart, or
// crafted with the key) is superseded, not believed; and a publisher that
// calls the replicas by each other's names moves no job onto a replica
// that lacks its row.
func TestFeedOldRunAndSwappedNamesNotBelieved(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	f := newFleetEnv(t, c, "")
	ctx := ctxT(t)
	node1, node2 := c.Replicas()[0], c.Replicas()[1]

	// Messages of publisher A about the replicas' first runs, recorded.
	pubA := f.publisher(t, "pub-a")
	recorded := f.record(t, 30)
	before := pubA.Snapshot().Database("main").Replicas[0]
	require.NoError(t, pubA.Close())

	// r1 restarts. A router that starts now polls it first and knows
	// its new run before it believes the feed.
	require.NoError(t, node1.Stop(ctx))
	require.NoError(t, node1.Start(ctx))
	f.publisher(t, "pub-b")
	r := f.feedRouter(t, func(c *Config) { c.PrimaryRate = rate.Inf })
	waitOnFeed(t, r)
	after := r.Snapshot().Database("main").Replicas[0]
	require.Equal(t, 1, after.Incarnation.Compare(before.Incarnation), "the restart gave r1 a newer run")

	// r1 stops replaying; r2 has the row.
	require.NoError(t, node1.PauseReplay(ctx))
	t.Cleanup(func() { _ = node1.ResumeReplay(context.Background()) })
	id, tok := f.write(t)
	lsnText, err := node1.ReplayLSN(ctx)
	require.NoError(t, err)
	require.Less(t, position.MustParseLSN(lsnText), tok.Entries[0].LSN)
	require.NoError(t, node2.WaitReplay(ctx, tok.Entries[0].LSN.String()))

	jobs := routeInBackground(t, r, tok, id, func(replica string) bool { return replica == "r1" })
	defer jobs.stop()

	superseded := func() int64 {
		return f.metric(t, "caughtup.consume.feed.observations.rejected", attribute.String(attrReason, "superseded"))
	}
	delayed := func() int64 {
		return f.metric(t, "caughtup.consume.feed.observations.rejected", attribute.String(attrReason, "delayed"))
	}
	// The recorded messages, replayed: this router never heard of their
	// publisher, so the feed package delivers them; they are of r1's
	// earlier run (superseded) or sent too long ago (delayed).
	s0, d0 := superseded(), delayed()
	for _, b := range recorded {
		require.NoError(t, f.rdb.Publish(ctx, feed.ChannelName(f.name), b).Err())
	}
	// Authentic, sent now, of r1's earlier run, claiming the row.
	crafted, err := feed.NewSender(feed.SenderConfig{Client: f.rdb, Feed: f.name, Name: "pub-a", Keys: f.keys,
		TTL: time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	defer crafted.Close()
	const n = 10
	for range n {
		require.NoError(t, crafted.Publish(feed.Observation{Database: "main", Node: "r1", Role: feed.RoleReplica,
			Replica: feed.ReplicaStatus{InRecovery: true, Replayed: tok.Entries[0].LSN + 1<<20, Epoch: tok.Entries[0].Epoch,
				Incarnation: before.Incarnation.PostmasterStart, RecoveryStart: before.Incarnation.RecoveryStart}}))
		require.NoError(t, crafted.Flush(ctx))
	}
	require.Eventually(t, func() bool { return superseded()-s0 >= n }, feedDeadline, time.Millisecond)
	t.Logf("%d recorded messages replayed: %d rejected by the feed package as replays (it read publisher A's stored values when it subscribed), %d superseded, %d delayed",
		len(recorded), metrictest.Sum(t, f.reader, "caughtup.feed.rejected", attribute.String("caughtup.reason", "replayed")),
		superseded()-s0-n, delayed()-d0)

	// A publisher that swaps the replicas' names: its "r1" is r2 (which
	// has the row) and its "r2" is r1 (which lacks it).
	s1 := superseded()
	f.publisherOf(t, "pub-swapped", map[string]replay.Database{"main": {Primary: f.primary, Replicas: []replay.Replica{
		{Name: "r1", Pool: f.replicas[1]}, {Name: "r2", Pool: f.replicas[0]}}}})
	require.Eventually(t, func() bool {
		return superseded()-s1+f.metric(t, "caughtup.consume.feed.observations.rejected", attribute.String(attrReason, "mismatch")) >= 2*n
	}, feedDeadline, time.Millisecond)
	jobs.stop()
	require.Positive(t, jobs.routed.Load())
	require.Zero(t, jobs.stale.Load(), "a job was routed onto r1, which lacks its row")
	rs := r.Snapshot().Database("main").Replicas[0]
	require.Less(t, rs.HighestReplayed, tok.Entries[0].LSN, "r1 was believed past its paused position")
	t.Logf("%d jobs routed during the replays and the swapped publisher, none onto r1; feed %+v", jobs.routed.Load(), r.Tracker().Feed())
}

// fallbackJobs routes n Sticky jobs whose token no replica can have
// reached (far past the primary's insert position): each needs a fallback
// to the primary. It returns the admissions with the times bracketing
// each call.
type admission struct{ before, after time.Time }

func fallbackJobs(t *testing.T, r *Router, n int) (admitted []admission, capped int) {
	t.Helper()
	tok := capture(t, r.cfg.Databases["main"].Primary, "main")
	tok.Entries[0].LSN += 1 << 40
	for range n {
		before := time.Now()
		_, d, err := r.Route(context.Background(), Job{Token: tok, Policy: Sticky})
		after := time.Now()
		if err != nil {
			require.ErrorIs(t, err, ErrCapped)
			capped++
			continue
		}
		require.True(t, d.Fallback, "%+v", d)
		admitted = append(admitted, admission{before, after})
	}
	return admitted, capped
}

// TestFleetBudgetShared: two routers share one fleet budget (their
// per-process caps off): in any span the admissions of both together
// stay within rate × span + burst.
func TestFleetBudgetShared(t *testing.T) {
	t.Parallel()
	f := newFleetEnv(t, pgtest.Shared(t), "")
	const rate_, burst = 40, 5
	// The budget is what is measured, so it gets the time to answer that
	// a loaded 2-core machine under -race needs: an answer later than
	// Timeout counts as unavailable, and with the per-process cap off such
	// a fallback is admitted unbounded (TestFleetBudgetRedisDown covers
	// that path). Any unavailable answer fails the test below, by name.
	budget, err := feed.NewBudget(feed.BudgetConfig{Client: f.rdb, Rate: rate_, Burst: burst, Prefix: "caughtup.budget." + f.name + ".",
		Timeout: 2 * time.Second})
	require.NoError(t, err)
	mk := func() *Router {
		return f.router(t, func(c *Config) {
			c.FleetBudget = budget
			c.PrimaryRate = rate.Inf
			c.MeterProvider = f.mp
		})
	}
	r1, r2 := mk(), mk()
	var mu sync.Mutex
	var all []admission
	capped := 0
	var wg sync.WaitGroup
	for _, r := range []*Router{r1, r2, r1, r2} {
		wg.Go(func() {
			a, c := fallbackJobs(t, r, 500)
			mu.Lock()
			all, capped = append(all, a...), capped+c
			mu.Unlock()
		})
	}
	wg.Wait()
	require.Zero(t, metrictest.Sum(t, f.reader, "caughtup.consume.fallback.budget",
		attribute.String(attrBudget, "fleet"), attribute.String(attrResult, "unavailable")),
		"the fleet budget did not answer within its Timeout: those fallbacks passed on the (disabled) per-process cap alone")
	slices.SortFunc(all, func(a, b admission) int { return a.before.Compare(b.before) })
	// Every admission i..j happened, on Redis's clock, between i's
	// before and the latest after among them: GCRA bounds their number.
	for i := range all {
		latest := all[i].after
		for j := i; j < len(all); j++ {
			latest = laterTime(latest, all[j].after)
			span := latest.Sub(all[i].before).Seconds()
			require.LessOrEqual(t, float64(j-i+1), rate_*span+burst+1e-9,
				"%d admissions within %.3fs: more than %d/s × span + %d", j-i+1, span, rate_, burst)
		}
	}
	require.Positive(t, capped, "the fleet budget refused some")
	require.EqualValues(t, len(all), metrictest.Sum(t, f.reader, "caughtup.consume.fallback.budget",
		attribute.String(attrBudget, "fleet"), attribute.String(attrResult, "allowed")))
	require.EqualValues(t, capped, metrictest.Sum(t, f.reader, "caughtup.consume.fallback.budget",
		attribute.String(attrBudget, "fleet"), attribute.String(attrResult, "spent")))
	t.Logf("%d fallbacks admitted, %d capped, over %v", len(all), capped, all[len(all)-1].after.Sub(all[0].before))

}

func laterTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// TestFleetBudgetRedisDown: with Redis unreachable the per-process cap
// alone bounds fallbacks, and that is counted and logged.
func TestFleetBudgetRedisDown(t *testing.T) {
	t.Parallel()
	rs, err := pgtest.StartRedis(ctxT(t))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, rs.Close()) })
	f := newFleetEnv(t, pgtest.Shared(t), rs.Addr())
	budget, err := feed.NewBudget(feed.BudgetConfig{Client: f.rdb, Rate: 1000, Burst: 1000})
	require.NoError(t, err)
	var logs syncBuffer
	r := f.router(t, func(c *Config) {
		c.FleetBudget = budget
		c.PrimaryRate, c.PrimaryBurst = 1e-9, 3
		c.MeterProvider = f.mp
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	require.NoError(t, rs.Stop())
	admitted, capped := fallbackJobs(t, r, 10)
	require.Len(t, admitted, 3, "the per-process burst")
	require.Equal(t, 7, capped)
	count := func(budget, result string) int64 {
		return metrictest.Sum(t, f.reader, "caughtup.consume.fallback.budget", attribute.String(attrBudget, budget), attribute.String(attrResult, result))
	}
	require.EqualValues(t, 3, count("fleet", "unavailable"))
	require.EqualValues(t, 3, count("local", "allowed"))
	require.EqualValues(t, 7, count("local", "spent"))
	require.Zero(t, count("fleet", "allowed"))
	require.Contains(t, logs.String(), "fleet primary budget is unavailable")
}

// TestFleetBudgetSpentRefundsLocal: when the fleet budget refuses,
// the local token taken for the job is given back.
func TestFleetBudgetSpentRefundsLocal(t *testing.T) {
	t.Parallel()
	f := newFleetEnv(t, pgtest.Shared(t), "")
	budget, err := feed.NewBudget(feed.BudgetConfig{Client: f.rdb, Rate: 1, Period: time.Hour, Burst: 2, Prefix: "caughtup.budget." + f.name + "."})
	require.NoError(t, err)
	r := f.router(t, func(c *Config) {
		c.FleetBudget = budget
		c.PrimaryRate, c.PrimaryBurst = 1e-9, 50
	})
	admitted, capped := fallbackJobs(t, r, 20)
	require.Len(t, admitted, 2)
	require.Equal(t, 18, capped)
	require.InDelta(t, 48, r.gate.lim.Tokens(), 0.01, "only the admitted fallbacks took local tokens")
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestFeedConfigValidation(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	base := func(fc *replay.FeedConfig) Config {
		return Config{Databases: map[string]replay.Database{"main": {Primary: &pgxpool.Pool{}}}, Tracker: replay.TrackerConfig{Feed: fc}}.WithDefaults()
	}
	require.ErrorIs(t, base(&replay.FeedConfig{}).Validate(), ErrInvalidConfig)
	err := base(&replay.FeedConfig{Client: rdb}).Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "Insecure")
	require.NoError(t, base(&replay.FeedConfig{Client: rdb, Insecure: true}).Validate())
	k, err := feed.GenerateKey("k1")
	require.NoError(t, err)
	cfg := base(&replay.FeedConfig{Client: rdb, Keys: feed.Keyring{Keys: []feed.Key{k}}})
	require.NoError(t, cfg.Validate())
	require.Equal(t, replay.DefaultStalenessBound/2, cfg.Tracker.Feed.SilenceBound)
	require.Equal(t, replay.DefaultFeedMaxDelay, cfg.Tracker.Feed.MaxDelay)
	require.Equal(t, feed.DefaultFeed, cfg.Tracker.Feed.Name)
	require.ErrorContains(t, base(&replay.FeedConfig{Client: rdb, Insecure: true, SilenceBound: 2 * time.Second}).Validate(), "SilenceBound")
	require.ErrorIs(t, base(&replay.FeedConfig{Client: rdb, Insecure: true, Name: "{bad}"}).Validate(), feed.ErrInvalidConfig)
	require.ErrorIs(t, base(&replay.FeedConfig{Client: rdb, Keys: feed.Keyring{Keys: []feed.Key{{ID: "k", Secret: []byte("short")}}}}).Validate(), ErrInvalidConfig)
}

// TestFeedInsecureIsLogged: a router that believes unsigned messages says
// so when it starts.
func TestFeedInsecureIsLogged(t *testing.T) {
	t.Parallel()
	f := newFleetEnv(t, pgtest.Shared(t), "")
	var logs syncBuffer
	r := f.feedRouter(t, func(c *Config) {
		c.Tracker.Feed.Keys, c.Tracker.Feed.Insecure = feed.Keyring{}, true
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	require.Contains(t, logs.String(), "WITHOUT checking")
	// It works with an unsigned publisher.
	f.publisher(t, "pub-insecure", func(pc *replay.PublisherConfig) { pc.Feed.Keys, pc.Feed.Insecure = feed.Keyring{}, true })
	waitOnFeed(t, r)
}

// TestFeedKeyRotation: routers hold the old and the new key; the
// publishers switch from one to the other (a new publisher signs with the
// new key, then the old one stops). The router stays on the feed and
// rejects nothing.
func TestFeedKeyRotation(t *testing.T) {
	t.Parallel()
	f := newFleetEnv(t, pgtest.Shared(t), "")
	k2, err := feed.GenerateKey("k2")
	require.NoError(t, err)
	both := feed.Keyring{Keys: []feed.Key{f.keys.Keys[0], k2}}
	old := f.publisher(t, "pub-old", func(pc *replay.PublisherConfig) { pc.Feed.Keys = both }) // signs with k1, the first
	r := f.feedRouter(t, func(c *Config) { c.Tracker.Feed.Keys = both })
	waitOnFeed(t, r)
	f.publisher(t, "pub-new", func(pc *replay.PublisherConfig) { pc.Feed.Keys = feed.Keyring{Keys: both.Keys, Current: "k2"} })
	received := func() int64 { return metrictest.Sum(t, f.reader, "caughtup.feed.received") }
	n0 := received()
	require.NoError(t, old.Close())
	require.Eventually(t, func() bool { return received() > n0+100 }, feedDeadline, time.Millisecond)
	s := r.Tracker().Feed()
	require.True(t, s.Active)
	require.Zero(t, metrictest.Sum(t, f.reader, "caughtup.feed.rejected"), "nothing rejected during the rotation")
	id, tok := f.write(t)
	seen(t, r, tok)
	d, ok := jobRead(t, r, Sticky, tok, id)
	require.True(t, ok, "%+v", d)
}

// replicaQueries sums the polls the router's tracker sent to replicas.
func replicaQueries(r *Router) uint64 {
	var n uint64
	for _, st := range r.Tracker().Stat() {
		if st.Replica != "" {
			n += st.Queries
		}
	}
	return n
}
