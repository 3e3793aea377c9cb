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

// Routers on a position feed and under the fleet budget: the real
// cluster, a real redis-server, replay.Publishers and Routers on their
// feed. What the tracker believes of the feed is tested beside it, in
// replay; here the routing on top of it. Waits are on conditions with
// generous deadlines; nothing asserts on time.

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
func (f *fleetEnv) publisher(t *testing.T, name string, mods ...func(*feed.SenderConfig, *replay.PublisherConfig)) *replay.Publisher {
	t.Helper()
	return f.publisherOf(t, name, f.databases(), mods...)
}

// publisherOf is publisher for the databases dbs.
func (f *fleetEnv) publisherOf(t *testing.T, name string, dbs map[string]replay.Database, mods ...func(*feed.SenderConfig, *replay.PublisherConfig)) *replay.Publisher {
	t.Helper()
	sc := feed.SenderConfig{Client: f.rdb, Feed: f.name, Name: name, Keys: f.keys, Logger: testLogger(t)}
	cfg := replay.PublisherConfig{Logger: testLogger(t)}
	for _, m := range mods {
		m(&sc, &cfg)
	}
	snd, err := feed.NewSender(sc)
	require.NoError(t, err)
	cfg.Feed = snd
	p, err := replay.NewPublisher(ctxT(t), dbs, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// feedRouter is a Router on the test's feed (a feed.Subscriber recording
// to the router's MeterProvider).
func (f *fleetEnv) feedRouter(t *testing.T, mods ...func(*Config)) *Router {
	t.Helper()
	src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: f.rdb, Feed: f.name, Keys: f.keys, MeterProvider: f.mp, Logger: testLogger(t)})
	require.NoError(t, err)
	return f.router(t, append([]func(*Config){func(c *Config) {
		c.Databases = f.databases()
		c.MeterProvider = f.mp
		c.Tracker.Feed = &replay.FeedConfig{Source: src}
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
