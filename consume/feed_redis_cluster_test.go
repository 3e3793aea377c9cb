package consume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
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

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/redistest"
)

// Routers on the position feed and the fleet budget while the Redis master
// that serves them is SIGKILLed and a Redis Cluster or the sentinels fail it
// over (testkit/redistest), on the real PostgreSQL cluster with replay
// paused at random. The Sentinel case is in feed_redis_sentinel_test.go.

// TestFeedRedisClusterFailover: the feed's channel, its values and the
// budget's key share one slot; its master is killed mid-run.
func TestFeedRedisClusterFailover(t *testing.T) {
	t.Parallel()
	rc, err := redistest.StartCluster(ctxT(t), redistest.ClusterOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, rc.Close()) })
	runRedisFailover(t, redisDeployment{
		kind: "cluster",
		options: func() *redis.UniversalOptions {
			return &redis.UniversalOptions{Addrs: rc.Addrs()}
		},
		// The feed's hash tag in the budget's prefix puts the budget's key
		// in the feed's slot, so that one kill takes both down.
		budgetPrefix: func(feedName string) string { return "caughtup.budget.{caughtup.feed." + feedName + "}." },
		killMaster: func(ctx context.Context, feedName string) (string, error) {
			m, err := rc.MasterOf(ctx, feed.ChannelName(feedName))
			if err != nil {
				return "", err
			}
			return m.Name(), m.Kill()
		},
		recovered: rc.WaitHealthy,
	})
}

// redisDeployment is a Redis that fails over: how to reach it, and how to
// kill the master that serves a feed.
type redisDeployment struct {
	kind         string
	options      func() *redis.UniversalOptions
	budgetPrefix func(feedName string) string
	killMaster   func(ctx context.Context, feedName string) (killed string, err error)
	recovered    func(ctx context.Context) error
}

// budgetCall is one Allow of a router's fleet budget, bracketed by the
// times before and after it.
type budgetCall struct {
	before, after time.Time
	allowed       bool
	err           error
}

// recordingBudget wraps a router's real *feed.Budget and keeps every
// answer it gave.
type recordingBudget struct {
	next FleetBudget
	mu   sync.Mutex
	log  []budgetCall
}

func (b *recordingBudget) Allow(ctx context.Context, key string) (bool, error) {
	before := time.Now()
	ok, err := b.next.Allow(ctx, key)
	after := time.Now()
	b.mu.Lock()
	b.log = append(b.log, budgetCall{before, after, ok, err})
	b.mu.Unlock()
	return ok, err
}

func (b *recordingBudget) calls() []budgetCall {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.log)
}

// span is an event known to have happened between before and after.
type span struct{ before, after time.Time }

// requireRateBound fails unless, for every run of events i..j (sorted by
// before), j−i+1 ≤ perSecond × (latest after − i's before) + burst: the
// bound of a token bucket or GCRA, whichever clock it ran on, as long as
// that clock advances with ours.
func requireRateBound(t *testing.T, events []span, perSecond float64, burst int, what string) {
	t.Helper()
	slices.SortFunc(events, func(a, b span) int { return a.before.Compare(b.before) })
	for i := range events {
		latest := events[i].after
		for j := i; j < len(events); j++ {
			latest = laterTime(latest, events[j].after)
			s := latest.Sub(events[i].before).Seconds()
			if float64(j-i+1) > perSecond*s+float64(burst)+1e-9 {
				require.Failf(t, "rate bound exceeded", "%s: %d within %.3fs (from %v), more than %.0f/s × span + %d",
					what, j-i+1, s, events[i].before.Format("15:04:05.000"), perSecond, burst)
			}
		}
	}
}

// feedSample is a router's feed status at one moment.
type feedSample struct {
	at     time.Time
	status replay.FeedStatus
}

// waitDialersGone waits until no go-redis pool is retrying a dead
// address: its goroutine sleeps 1s between dials and ends on the next
// wake after its client closed, which goleak in TestMain would see.
func waitDialersGone(t *testing.T) {
	deadline := time.Now().Add(10 * time.Second)
	buf := make([]byte, 1<<20)
	for time.Now().Before(deadline) {
		n := runtime.Stack(buf, true)
		if !strings.Contains(string(buf[:n]), "pool.(*ConnPool).tryDial") {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func runRedisFailover(t *testing.T, dep redisDeployment) {
	t.Cleanup(func() { waitDialersGone(t) })
	c := pgtest.Shared(t)
	e := setup(t, c)
	client := func() redis.UniversalClient {
		o := dep.options()
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout = 200*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
		rdb := redis.NewUniversalClient(o)
		t.Cleanup(func() { _ = rdb.Close() })
		return rdb
	}
	k, err := feed.GenerateKey("k1")
	require.NoError(t, err)
	keys := feed.Keyring{Keys: []feed.Key{k}}
	name := fmt.Sprintf("failover-%s.%d", dep.kind, feedSeq.Add(1))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })

	reps := make([]replay.Replica, len(e.replicas))
	for i, p := range e.replicas {
		reps[i] = replay.Replica{Name: fmt.Sprintf("r%d", i+1), Pool: p}
	}
	dbs := map[string]replay.Database{"main": {Primary: e.primary, Replicas: reps}}
	for _, pub := range []string{"pub-a", "pub-b"} {
		snd, err := feed.NewSender(feed.SenderConfig{Client: client(), Feed: name, Name: pub, Keys: keys, Logger: testLogger(t)})
		require.NoError(t, err)
		p, err := replay.NewPublisher(ctxT(t), dbs, replay.PublisherConfig{Feed: snd, Logger: testLogger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
	}

	// Three routers, each a process of its own: its Redis client, its
	// subscription, its Budget (rate fleetRate, shared in Redis) and its
	// per-process cap (localRate). The fleet budget binds: three local
	// caps add up to four times it.
	const fleetRate, fleetBurst = 30, 5
	const localRate, localBurst = 40, 5
	var logs syncBuffer
	budgets := make([]*recordingBudget, 3)
	routers := make([]*Router, 3)
	for i := range routers {
		rdb := client()
		// Timeout 250ms rather than 50ms: on a loaded 2-core machine with
		// -race, 50ms round trips time out without any failover, which
		// would blur what the failover costs.
		b, err := feed.NewBudget(feed.BudgetConfig{Client: rdb, Rate: fleetRate, Burst: fleetBurst, Prefix: dep.budgetPrefix(name),
			Timeout: 250 * time.Millisecond})
		require.NoError(t, err)
		budgets[i] = &recordingBudget{next: b}
		log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
		src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: rdb, Feed: name, Keys: keys, MeterProvider: mp, Logger: log})
		require.NoError(t, err)
		routers[i] = e.router(t, func(cfg *Config) {
			cfg.Databases = dbs
			cfg.Tracker.Feed = &replay.FeedConfig{Source: src}
			cfg.FleetBudget = budgets[i]
			cfg.PrimaryRate, cfg.PrimaryBurst = localRate, localBurst
			cfg.WaitBudget = 50 * time.Millisecond
			cfg.MeterProvider = mp
			cfg.Logger = log
		})
	}
	for _, r := range routers {
		waitOnFeed(t, r)
	}
	rS := routers[0] // routes the jobs whose reads are checked

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	bg, stopBG := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { stopBG(); wg.Wait() }()
	wg.Go(func() { c.PauseRandomly(bg, 150*time.Millisecond, 100*time.Millisecond, t.Logf) })

	// Routers 1 and 2 flood the primary with jobs whose token no replica
	// can reach, paced so that the cap, not the CPU, refuses them.
	admissions := make([][]span, 3)
	var admMu sync.Mutex
	admit := func(i int, s span) {
		admMu.Lock()
		admissions[i] = append(admissions[i], s)
		admMu.Unlock()
	}
	ahead := capture(t, e.primary, "main")
	ahead.Entries[0].LSN += 1 << 40
	var floodErrors atomic.Int64
	for i := 1; i <= 2; i++ {
		wg.Go(func() {
			for bg.Err() == nil {
				before := time.Now()
				_, d, err := routers[i].Route(context.Background(), Job{Token: ahead, Policy: Sticky})
				after := time.Now()
				switch {
				case err == nil && d.Fallback:
					admit(i, span{before, after})
				case errors.Is(err, ErrCapped):
				default:
					if floodErrors.Add(1) == 1 {
						t.Errorf("flood on router %d: %+v, %v", i, d, err)
					}
				}
				time.Sleep(2 * time.Millisecond)
			}
		})
	}
	// Every router's feed status, sampled.
	samples := make([][]feedSample, 3)
	wg.Go(func() {
		for bg.Err() == nil {
			now := time.Now()
			for i, r := range routers {
				samples[i] = append(samples[i], feedSample{now, r.Tracker().Feed()})
			}
			time.Sleep(2 * time.Millisecond)
		}
	})

	var jobs, stale, lost, onReplica, onPrimary, retries int
	runJob := func(i int) {
		id, tok := e.write(t)
		policy := Delayed
		if i%3 == 0 {
			policy = Sticky
		}
		jobDeadline := time.Now().Add(30 * time.Second)
		for {
			before := time.Now()
			hctx, d, err := rS.Route(ctx, Job{Token: tok, Policy: policy})
			after := time.Now()
			if errors.Is(err, ErrDeferred) || errors.Is(err, ErrCapped) {
				// A queue would run it again later.
				retries++
				if time.Now().After(jobDeadline) {
					lost++
					t.Errorf("job %d never ran: %v", i, err)
					return
				}
				time.Sleep(time.Millisecond)
				continue
			}
			if err != nil {
				lost++
				t.Errorf("job %d: %v", i, err)
				return
			}
			jobs++
			if d.Fallback {
				admit(0, span{before, after})
			}
			if !found(t, DB(hctx, "main"), id) {
				stale++
				t.Errorf("job %d read stale data: %+v", i, d)
			}
			if d.Databases[0].Replica != "" {
				onReplica++
			} else {
				onPrimary++
			}
			return
		}
	}

	const before, after = 60, 60
	for i := range before {
		runJob(i)
	}
	killedAt := time.Now()
	killed, err := dep.killMaster(ctx, name)
	require.NoError(t, err)
	t.Logf("%s: SIGKILLed %s, the master of the feed's and the budget's slot, after %d jobs", dep.kind, killed, jobs)
	var recoveredAt atomic.Pointer[time.Time]
	recoverErr := make(chan error, 1)
	wg.Go(func() {
		err := dep.recovered(ctx)
		now := time.Now()
		recoveredAt.Store(&now)
		recoverErr <- err
	})
	// Jobs go on through the failover, until Redis has recovered, every
	// router is back on the feed (after having left it) and the fleet
	// budget answers again; then some more.
	backOnFeed := func() bool {
		for _, r := range routers {
			s := r.Tracker().Feed()
			if !s.Active || s.LocalNodes != 0 || !s.Health.Since.After(killedAt) {
				return false
			}
		}
		return true
	}
	budgetBack := func() bool {
		for _, b := range budgets[1:] {
			calls := b.calls()
			if l := len(calls); l == 0 || calls[l-1].err != nil || !calls[l-1].before.After(killedAt) {
				return false
			}
		}
		return true
	}
	i := before
	for ; recoveredAt.Load() == nil || !backOnFeed() || !budgetBack(); i++ {
		require.Less(t, time.Since(killedAt), time.Minute, "no recovery within a minute of the kill")
		runJob(i)
	}
	require.NoError(t, <-recoverErr)
	allBackAt := time.Now()
	for range after {
		runJob(i)
		i++
	}
	stopBG()
	wg.Wait()

	// 0 stale, 0 lost.
	require.Zero(t, stale, "stale reads")
	require.Zero(t, lost, "lost jobs")
	require.Zero(t, floodErrors.Load())
	require.Positive(t, onReplica, "the replicas served jobs")

	// The failover was noticed: every router left the feed after the kill
	// and came back to it.
	noticed := make([]time.Duration, 3)
	back := make([]time.Duration, 3)
	for i, ss := range samples {
		left := -1
		for j, s := range ss {
			if s.at.After(killedAt) && s.status.Health.State != feed.StateSubscribed && left < 0 {
				left = j
			}
			if left >= 0 && j > left && s.status.Health.State == feed.StateSubscribed && s.status.Active && s.status.LocalNodes == 0 {
				back[i] = s.at.Sub(killedAt)
				break
			}
		}
		require.GreaterOrEqual(t, left, 0, "router %d never noticed the failover", i)
		noticed[i] = ss[left].at.Sub(killedAt)
		require.Positive(t, back[i], "router %d never came back to the feed", i)
	}

	// The budget: what the fleet budget allowed kept within its rate in
	// every window; while it was unavailable each router's own cap bound
	// its fallbacks, and that was counted and logged.
	var allowed []span
	var unavailable, unavailableBefore int
	var firstUnavailable, lastUnavailable time.Time
	for _, b := range budgets {
		for _, call := range b.calls() {
			switch {
			case call.err != nil:
				require.ErrorIs(t, call.err, feed.ErrBudgetUnavailable)
				unavailable++
				if call.before.Before(killedAt) {
					unavailableBefore++ // a slow answer on a loaded machine
					continue
				}
				if firstUnavailable.IsZero() || call.before.Before(firstUnavailable) {
					firstUnavailable = call.before
				}
				lastUnavailable = laterTime(lastUnavailable, call.after)
			case call.allowed:
				allowed = append(allowed, span{call.before, call.after})
			}
		}
	}
	requireRateBound(t, allowed, fleetRate, fleetBurst, "fleet budget allowances")
	var admitted int
	var during int // admissions while the budget was unavailable
	for i, a := range admissions {
		requireRateBound(t, slices.Clone(a), localRate, localBurst, fmt.Sprintf("router %d's admissions", i))
		admitted += len(a)
		for _, s := range a {
			if !s.before.Before(firstUnavailable) && !s.after.After(lastUnavailable) {
				during++
			}
		}
	}
	require.Greater(t, unavailable, unavailableBefore, "the budget was unavailable during the failover")
	count := func(budget, result string) int64 {
		return metrictest.Sum(t, reader, "caughtup.consume.fallback.budget", attribute.String(attrBudget, budget), attribute.String(attrResult, result))
	}
	require.EqualValues(t, unavailable, count("fleet", "unavailable"))
	require.EqualValues(t, len(allowed), count("fleet", "allowed"))
	require.Contains(t, logs.String(), "fleet primary budget is unavailable")

	took := allBackAt.Sub(killedAt)
	window := lastUnavailable.Sub(firstUnavailable)
	t.Logf("%s: %d jobs checked (%d on a replica, %d on the primary, %d deferrals/caps retried), 0 stale, 0 lost",
		dep.kind, jobs, onReplica, onPrimary, retries)
	t.Logf("%s: Redis recovered (harness) %v after the kill; routers left the feed after %v and were back on it after %v; all back %v",
		dep.kind, recoveredAt.Load().Sub(killedAt), noticed, back, took)
	var fleetBefore int
	var firstCall time.Time
	for _, a := range allowed {
		if a.before.Before(killedAt) {
			fleetBefore++
		}
		if firstCall.IsZero() || a.before.Before(firstCall) {
			firstCall = a.before
		}
	}
	t.Logf("%s: %d fallbacks admitted, %d of them by the fleet budget (%d/s + %d); before the kill %d allowed in %v (%.1f/s)",
		dep.kind, admitted, len(allowed), fleetRate, fleetBurst, fleetBefore, killedAt.Sub(firstCall).Round(time.Millisecond),
		float64(fleetBefore)/killedAt.Sub(firstCall).Seconds())
	t.Logf("%s: budget unavailable %d times before the kill (slow answers), %d times from %v to %v after it (%v): %d admissions by the local caps meanwhile (%.0f/s; caps %d × (%d/s + %d))",
		dep.kind, unavailableBefore, unavailable-unavailableBefore, firstUnavailable.Sub(killedAt).Round(time.Millisecond), lastUnavailable.Sub(killedAt).Round(time.Millisecond),
		window.Round(time.Millisecond), during, float64(during)/max(window.Seconds(), 1e-3), len(routers), localRate, localBurst)
}
