package consume

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The tests on the shared cluster pause its replicas, so they do not run
// in parallel with each other.

func TestRouteCaughtUp(t *testing.T) {
	e := setup(t, pgtest.Shared(t))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := e.router(t, func(c *Config) { c.MeterProvider = mp })
	ctx := ctxT(t)

	id, tok := e.write(t)
	seen(t, r, tok)
	header, err := tok.Encode()
	require.NoError(t, err)

	hctx, d, err := r.Route(ctx, hjob(header, Sticky))
	require.NoError(t, err)
	require.Equal(t, OutcomeReplica, d.Outcome)
	pool := DB(hctx, "main")
	require.NotSame(t, e.primary, pool)
	require.True(t, found(t, pool, id), "the replica chosen has the row")
	got, ok := DecisionFrom(hctx)
	require.True(t, ok)
	require.Equal(t, d.Outcome, got.Outcome)
	_, err = Pool(hctx, "other")
	require.ErrorIs(t, err, ErrUnknownDatabase, "a database the router does not know")
	require.ErrorContains(t, err, `"main"`, "the error names the configured databases")
	require.PanicsWithError(t, err.Error(), func() { DB(hctx, "other") })
	_, err = Pool(ctx, "main")
	require.ErrorIs(t, err, ErrNotRouted)
	require.Panics(t, func() { DB(ctx, "main") }, "an unrouted context")

	// database/sql over the same chosen pool.
	sdb, err := SQLDB(hctx, "main")
	require.NoError(t, err)
	var n int
	require.NoError(t, sdb.QueryRowContext(hctx, `SELECT count(*) FROM items WHERE id = $1`, id).Scan(&n))
	require.Equal(t, 1, n, "the *sql.DB reads the replica chosen, which has the row")
	var inRecovery bool
	require.NoError(t, sdb.QueryRowContext(hctx, `SELECT pg_is_in_recovery()`).Scan(&inRecovery))
	require.True(t, inRecovery, "SQLDB hands out the replica, not the primary")
	_, err = SQLDB(ctx, "main")
	require.ErrorIs(t, err, ErrNotRouted)

	// Jobs the handler enqueues must see at least what it read.
	child, ok := enqueue.TokenFrom(hctx)
	require.True(t, ok)
	ce, ok := child.Entry("main")
	require.True(t, ok)
	require.GreaterOrEqual(t, ce.LSN, tok.Entries[0].LSN)
	require.Equal(t, d.Databases[0].ReadAt.LSN, ce.LSN)
	if ce.LSN > tok.Entries[0].LSN {
		require.Equal(t, position.SourceReplica, ce.Source)
	}

	// No token and a malformed one read the primary.
	hctx, d, err = r.Route(ctx, hjob("", Sticky))
	require.NoError(t, err)
	require.Equal(t, OutcomePrimaryNoToken, d.Outcome)
	require.Same(t, e.primary, DB(hctx, "main"))
	_, ok = enqueue.TokenFrom(hctx)
	require.False(t, ok)
	hctx, d, err = r.Route(ctx, hjob("v1;garbage", Delayed))
	require.NoError(t, err)
	require.Equal(t, ReasonMalformedToken, d.Reason)
	require.Same(t, e.primary, DB(hctx, "main"))

	// Always keeps the token for children but reads the primary.
	hctx, d, err = r.Route(ctx, hjob(header, Always))
	require.NoError(t, err)
	require.Equal(t, ReasonPolicyAlways, d.Reason)
	require.Same(t, e.primary, DB(hctx, "main"))
	child, _ = enqueue.TokenFrom(hctx)
	require.Equal(t, tok.Entries, child.Entries)

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	byName := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		require.Contains(t, []string{ScopeName, replay.ScopeName}, sm.Scope.Name)
		for _, m := range sm.Metrics {
			byName[m.Name] = m
			require.NotEmpty(t, m.Unit, m.Name)
		}
	}
	sum := byName["caughtup.consume.decisions"].Data.(metricdata.Sum[int64])
	outcomes := map[string]int64{}
	for _, dp := range sum.DataPoints {
		o, _ := dp.Attributes.Value(attrOutcome)
		sys, _ := dp.Attributes.Value("db.system.name")
		require.Equal(t, "postgresql", sys.AsString())
		outcomes[o.AsString()] += dp.Value
	}
	require.Equal(t, map[string]int64{"replica": 1, "primary_no_token": 2, "primary": 1}, outcomes)
	require.Equal(t, "By", byName["caughtup.consume.replica.lag"].Unit)
	require.Len(t, byName["caughtup.consume.replica.lag"].Data.(metricdata.Gauge[int64]).DataPoints, 2)
	require.Len(t, byName["caughtup.consume.tracker.staleness"].Data.(metricdata.Gauge[float64]).DataPoints, 3)
	missing := byName["caughtup.consume.tokens.missing"].Data.(metricdata.Sum[int64])
	require.Len(t, missing.DataPoints, 2)
}

func TestRouteWaitsForReplay(t *testing.T) {
	c := pgtest.Shared(t)
	e := setup(t, c)
	// A wake-up that never came would end the wait after the budget with a
	// deferral, which fails the outcome check below.
	r := e.router(t, func(c *Config) { c.WaitBudget = time.Minute })
	pauseAll(t, c)
	id, tok := e.write(t)

	type result struct {
		ctx context.Context
		d   Decision
		err error
		at  time.Time
	}
	done := make(chan result, 1)
	go func() {
		ctx, d, err := r.Route(context.Background(), Job{Token: tok, Policy: Delayed})
		done <- result{ctx, d, err, time.Now()}
	}()
	// The job waits on both replicas, which the tracker now polls fast.
	waitUntil(t, r, "the job waits on both replicas", func(*replay.Snapshot) bool { return waiting(r) == 2 })
	select {
	case res := <-done:
		t.Fatalf("routed while every replica was paused: %+v", res.d)
	default:
	}
	// The waiting job makes the tracker poll the replicas every
	// WaitPollInterval (nextPoll), and they are polled while it waits.
	for i, st := range replicaStats(r) {
		require.Positive(t, st.Watchers, "replica %s is watched while a job waits", st.Replica)
		require.Eventually(t, func() bool { return replicaStats(r)[i].Queries > st.Queries+2 }, 10*time.Second, time.Millisecond)
	}

	resumed := time.Now()
	resumeAll(t, c)
	res := <-done
	require.NoError(t, res.err)
	require.Equal(t, OutcomeReplicaWaited, res.d.Outcome)
	require.Positive(t, res.d.Waited)
	pool := DB(res.ctx, "main")
	require.NotSame(t, e.primary, pool)
	require.True(t, found(t, pool, id), "the replica the job waited for has the row")
	t.Logf("wait returned %v after resume (waited %v in all)", res.at.Sub(resumed), res.d.Waited)

	// With nobody waiting the tracker is back to one query per
	// PollInterval.
	for _, st := range replicaStats(r) {
		require.Zero(t, st.Watchers, "replica %s is no longer watched", st.Replica)
	}
}

func TestRouteLagPastBudget(t *testing.T) {
	c := pgtest.Shared(t)
	e := setup(t, c)
	r := e.router(t, func(c *Config) { c.WaitBudget = 200 * time.Millisecond })
	ctx := ctxT(t)
	pauseAll(t, c)
	id, tok := e.write(t)

	// Delayed: waits the budget, then defers.
	_, d, err := r.Route(ctx, Job{Token: tok, Policy: Delayed})
	var de *DeferError
	require.ErrorAs(t, err, &de)
	require.ErrorIs(t, err, ErrDeferred)
	require.NotErrorIs(t, err, ErrCapped)
	require.Equal(t, OutcomeDeferred, d.Outcome)
	require.Equal(t, ReasonReplicaBehind, d.Reason)
	require.Equal(t, time.Second, de.Delay)
	require.GreaterOrEqual(t, d.Waited, 200*time.Millisecond, "the whole budget")
	require.Zero(t, waiting(r))

	// Sticky: the primary at once.
	hctx, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Zero(t, d.Waited, "sticky does not wait")
	require.Equal(t, OutcomePrimary, d.Outcome)
	require.Equal(t, ReasonReplicaBehind, d.Reason)
	require.Same(t, e.primary, DB(hctx, "main"))
	require.True(t, found(t, DB(hctx, "main"), id))

	// Delayed past MaxAge: the primary without waiting.
	old := tok
	old.CapturedAt = time.Now().Add(-3 * time.Minute)
	_, d, err = r.Route(ctx, Job{Token: old, Policy: Delayed})
	require.NoError(t, err)
	require.Equal(t, ReasonDeadline, d.Reason)
	require.Zero(t, d.Waited)

	// Over the cap: sticky is refused (retryable); delayed defers, since
	// the lag it would have waited out counts as no healthy replica here.
	capped := e.router(t, func(c *Config) {
		c.WaitBudget = -1
		c.Tracker.MaxLagBytes = 1
		c.PrimaryRate, c.PrimaryBurst = rate.Every(time.Hour), 1
	})
	waitUntil(t, capped, "no replica is healthy", func(s *replay.Snapshot) bool {
		for _, rs := range s.Database("main").Replicas {
			if rs.Healthy {
				return false
			}
		}
		return true
	})
	_, d, err = capped.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimary, d.Outcome, "the burst allows one")
	require.Equal(t, ReasonNoHealthyReplica, d.Reason)
	_, d, err = capped.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.ErrorIs(t, err, ErrCapped)
	require.Equal(t, OutcomeCapped, d.Outcome)
	_, d, err = capped.Route(ctx, Job{Token: tok, Policy: Delayed})
	require.ErrorIs(t, err, ErrDeferred)
	require.NotErrorIs(t, err, ErrCapped)
	require.Equal(t, OutcomeDeferred, d.Outcome)
	require.Equal(t, ReasonCapped, d.Reason)
	// A delayed job that is merely behind defers for lag, cap or not.
	_, d, err = r.Route(ctx, Job{Token: tok, Policy: Delayed})
	require.ErrorIs(t, err, ErrDeferred)
	require.Equal(t, ReasonReplicaBehind, d.Reason)
	// No token and Always are not capped.
	_, d, err = capped.Route(ctx, hjob("", Sticky))
	require.NoError(t, err)
	require.Equal(t, OutcomePrimaryNoToken, d.Outcome)
	_, d, err = capped.Route(ctx, Job{Token: tok, Policy: Always})
	require.NoError(t, err)
	require.Equal(t, ReasonPolicyAlways, d.Reason)
}

// TestRouteFutureToken: a job whose token was captured an hour ahead of
// the consumer's clock, and whose position no replica has, reads the
// primary after its wait instead of being deferred for the hour.
func TestRouteFutureToken(t *testing.T) {
	c := pgtest.Shared(t)
	e := setup(t, c)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := e.router(t, func(c *Config) { c.WaitBudget = 100 * time.Millisecond; c.MeterProvider = mp })
	pauseAll(t, c)
	id, tok := e.write(t)
	tok.CapturedAt = time.Now().Add(time.Hour)

	hctx, d, err := r.Route(ctxT(t), Job{Token: tok, Policy: Delayed})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimary, d.Outcome)
	require.Equal(t, ReasonUnknownAge, d.Reason)
	require.Greater(t, d.ClockSkew, 59*time.Minute)
	require.Same(t, e.primary, DB(hctx, "main"))
	require.True(t, found(t, DB(hctx, "main"), id))
	require.Equal(t, int64(1), total(sums(t, reader)["caughtup.consume.tokens.future"]))
}

func TestRouteContextEndsDuringWait(t *testing.T) {
	c := pgtest.Shared(t)
	e := setup(t, c)
	r := e.router(t, func(c *Config) { c.WaitBudget = time.Minute })
	pauseAll(t, c)
	_, tok := e.write(t)

	// The context's deadline shortens the budget: the job is deferred
	// rather than failed.
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	_, d, err := r.Route(ctx, Job{Token: tok, Policy: Delayed})
	require.ErrorIs(t, err, ErrDeferred)
	require.Equal(t, OutcomeDeferred, d.Outcome)

	// A cancellation abandons the job.
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		_, _, err := r.Route(ctx, Job{Token: tok, Policy: Delayed})
		errc <- err
	}()
	waitUntil(t, r, "the job waits", func(*replay.Snapshot) bool { return waiting(r) > 0 })
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled)
	require.Zero(t, waiting(r))
}

// TestRouteDoesNotQuery routes many caught-up jobs between two polls (the
// tracker polls once an hour here) and checks that the tracker sent no
// query meanwhile: routing reads the snapshot, never the replicas. The
// rates are in BenchmarkTrackerQueries.
func TestRouteDoesNotQuery(t *testing.T) {
	c := pgtest.Shared(t)
	e := setup(t, c)
	_, tok := e.write(t)
	require.NoError(t, c.WaitReplicasCaughtUp(ctxT(t)))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	// NewRouter returns once every node has answered; the next polls are
	// an hour later.
	r := e.router(t, func(c *Config) { c.Tracker.PollInterval = time.Hour; c.MeterProvider = mp })
	queries := func() int64 { return total(sums(t, reader)["caughtup.consume.tracker.queries"]) }
	q0 := queries()
	require.GreaterOrEqual(t, q0, int64(3), "one per node at least")

	ctx := ctxT(t)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 2500 {
				if _, d, err := r.Route(ctx, Job{Token: tok, Policy: Delayed}); err != nil || d.Outcome != OutcomeReplica {
					t.Errorf("outcome %s: %v", d.Outcome, err)
					return
				}
			}
		})
	}
	wg.Wait()
	require.Equal(t, q0, queries(), "10,000 jobs routed without a query")
	require.Equal(t, int64(10000), total(sums(t, reader)["caughtup.consume.decisions"]))
}

// TestRouteTwoEntriesForOneDatabase: a token built by hand with two
// entries for one database, the first caught up and the second not, is
// routed by its furthest entry: the pool handed out has both writes.
func TestRouteTwoEntriesForOneDatabase(t *testing.T) {
	c := pgtest.Shared(t)
	e := setup(t, c)
	r := e.router(t)
	ctx := ctxT(t)
	_, first := e.write(t)
	seen(t, r, first)
	pauseAll(t, c)
	defer resumeAll(t, c)
	id, second := e.write(t)
	for _, entries := range [][]position.Entry{
		{first.Entries[0], second.Entries[0]},
		{second.Entries[0], first.Entries[0]},
	} {
		tok := position.Token{Entries: entries, CapturedAt: second.CapturedAt}
		hctx, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
		require.NoError(t, err)
		require.Len(t, d.Databases, 1, "one decision per database")
		require.Equal(t, OutcomePrimary, d.Outcome, "no replica has the second write")
		require.True(t, found(t, DB(hctx, "main"), id), "the pool handed out has the furthest write")
	}
}
