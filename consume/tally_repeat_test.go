package consume

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/spantest"
)

// switchable is a tracker whose snapshot a test replaces.
type switchable struct {
	s atomic.Pointer[replay.Snapshot]
}

func (w *switchable) Snapshot() *replay.Snapshot { return w.s.Load() }
func (*switchable) Watch(string) func()          { return func() {} }
func (*switchable) Close() error                 { return nil }

// repeatRouter is a Router with replicas r1 and r2 caught up with
// repeatTok, on a clock the test moves (now) and a snapshot it replaces
// (tr), with a staleness bound of one second.
func repeatRouter(t *testing.T, mods ...func(*Config)) (*Router, *switchable, *atomic.Int64) {
	t.Helper()
	var now atomic.Int64 // nanoseconds after t0
	tr := &switchable{}
	tr.s.Store(snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/3000000"))))
	r := unitRouter(t, tr.Snapshot(), append([]func(*Config){func(c *Config) {
		c.Now = func() time.Time { return t0.Add(time.Duration(now.Load())) }
		c.WaitBudget = -1
		c.Tracker.StalenessBound = time.Second
	}}, mods...)...)
	r.tr = tr
	return r, tr, &now
}

var repeatTok = tok(time.Second, ent("main", 1, "0/1000000"))

// routeRepeat routes a Delayed job of tok through tally in ctx.
func routeRepeat(t *testing.T, tally *Tally, ctx context.Context, tok position.Token) (context.Context, Decision) {
	t.Helper()
	hctx, d, err := tally.Route(ctx, Job{Token: tok, Policy: Delayed})
	require.NoError(t, err)
	return hctx, d
}

// TestTallyRepeat: a job with the token, policy and parent context of the
// Tally's last job, on the same snapshot, gets that job's context and
// decision; each is still counted as a decision of its own, the same as
// the Router's (TestTally).
func TestTallyRepeat(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r, _, _ := repeatRouter(t, func(c *Config) { c.MeterProvider = mp })
	tally := r.NewTally()
	ctx := context.Background()

	first, d := routeRepeat(t, tally, ctx, repeatTok)
	require.Equal(t, OutcomeReplica, d.Outcome)
	const jobs = 50
	for range jobs - 1 {
		// A decoded copy of the same token, as a HeaderDecoder gives.
		same := position.Token{Entries: []position.Entry{repeatTok.Entries[0]}, CapturedAt: repeatTok.CapturedAt}
		hctx, dd := routeRepeat(t, tally, ctx, same)
		require.True(t, hctx == first, "the same token repeats the last job's context")
		require.Equal(t, d, dd)
	}
	tally.Flush(ctx)
	counts := sums(t, reader)
	var decisions, routes int64
	for _, v := range counts["caughtup.consume.decisions"] {
		decisions += v
	}
	for _, v := range counts["caughtup.consume.database.routes"] {
		routes += v
	}
	require.Equal(t, int64(jobs), decisions, "every job is counted")
	require.Equal(t, int64(jobs), routes)

	other, _ := routeRepeat(t, tally, ctx, tok(time.Second, ent("main", 1, "0/1000001")))
	require.False(t, other == first, "another position is decided afresh")
	again, _ := routeRepeat(t, tally, ctx, repeatTok)
	require.False(t, again == first, "only the last job's decision is repeated")
	older := tok(2*time.Second, ent("main", 1, "0/1000000"))
	hctx, _ := routeRepeat(t, tally, ctx, older)
	require.False(t, hctx == again, "another capture time is decided afresh")
}

// TestTallyRepeatOnlyWhatHolds: whatever could make the decision differ
// now, or belong to one job only, makes the Tally decide afresh; and what
// it then decides is what the Router decides.
func TestTallyRepeatOnlyWhatHolds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	type step func(t *testing.T, r *Router, tr *switchable, now *atomic.Int64, first context.Context) context.Context // the next job's parent
	for name, c := range map[string]struct {
		step step
		want Outcome // of the job decided afresh
	}{
		"stale replica": {
			// Past the staleness bound of the observation of the replica
			// chosen, with the tracker stuck on the same snapshot: the
			// tracker is stale and the job reads the primary.
			step: func(t *testing.T, r *Router, tr *switchable, now *atomic.Int64, first context.Context) context.Context {
				now.Store(int64(time.Second))
				return ctx
			},
			want: OutcomePrimary,
		},
		"new snapshot": {
			step: func(t *testing.T, r *Router, tr *switchable, now *atomic.Int64, first context.Context) context.Context {
				tr.s.Store(snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", failing), rep("r2", 1, "0/3000000", failing))))
				return ctx
			},
			want: OutcomePrimary,
		},
		"replica failed the job": {
			step: func(t *testing.T, r *Router, tr *switchable, now *atomic.Int64, first context.Context) context.Context {
				routingFrom(first).attempt.Fail()
				return ctx
			},
			want: OutcomeReplica,
		},
		"other parent": {
			step: func(t *testing.T, r *Router, tr *switchable, now *atomic.Int64, first context.Context) context.Context {
				type key struct{}
				return context.WithValue(ctx, key{}, 1)
			},
			want: OutcomeReplica,
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			r, tr, now := repeatRouter(t)
			tally := r.NewTally()
			first, d := routeRepeat(t, tally, ctx, repeatTok)
			require.Equal(t, OutcomeReplica, d.Outcome)
			parent := c.step(t, r, tr, now, first)
			hctx, got := routeRepeat(t, tally, parent, repeatTok)
			require.False(t, hctx == first, "decided afresh")
			require.Equal(t, c.want, got.Outcome)
			_, want, err := r.Route(parent, Job{Token: repeatTok, Policy: Delayed})
			require.NoError(t, err)
			require.Equal(t, want.Outcome, got.Outcome)
			require.Equal(t, want.Reason, got.Reason)
		})
	}
	t.Run("policy", func(t *testing.T) {
		t.Parallel()
		r, _, _ := repeatRouter(t)
		tally := r.NewTally()
		first, _ := routeRepeat(t, tally, ctx, repeatTok)
		hctx, d, err := tally.Route(ctx, Job{Token: repeatTok, Policy: Sticky})
		require.NoError(t, err)
		require.False(t, hctx == first)
		require.Equal(t, Sticky, d.Policy)
	})
	t.Run("default policy", func(t *testing.T) {
		t.Parallel()
		r, _, _ := repeatRouter(t) // DefaultPolicy Delayed
		tally := r.NewTally()
		first, _ := routeRepeat(t, tally, ctx, repeatTok)
		hctx, _, err := tally.Route(ctx, Job{Token: repeatTok, Policy: PolicyDefault})
		require.NoError(t, err)
		require.True(t, hctx == first, "PolicyDefault is the Delayed the first job got")
	})
	t.Run("verifier", func(t *testing.T) {
		t.Parallel()
		r, _, _ := repeatRouter(t)
		tally := r.NewTally()
		first, _ := routeRepeat(t, tally, ctx, repeatTok)
		calls := 0
		verify := func(context.Context, DatabaseDecision, *pgxpool.Pool) Verification {
			calls++
			return Verification{Verdict: VerifyFresh}
		}
		hctx, _, err := tally.Route(ctx, Job{Token: repeatTok, Policy: Delayed, Verify: verify})
		require.NoError(t, err)
		require.False(t, hctx == first)
		require.Equal(t, 1, calls, "the Verifier is asked")
	})
	t.Run("waited", func(t *testing.T) {
		t.Parallel()
		// Replay reaches the token during the first job's wait: its
		// decision (replica_waited) is not one to repeat. (A snapshot
		// built by hand never signals a change: the wait ends with its
		// budget, then decides on the snapshot of the moment.)
		r, tr, _ := repeatRouter(t, func(c *Config) { c.WaitBudget = time.Second })
		behind := snap(dbState("main", 1, nil, rep("r1", 1, "0/100"), rep("r2", 1, "0/100")))
		tr.s.Store(behind)
		tally := r.NewTally()
		go func() {
			time.Sleep(10 * time.Millisecond)
			tr.s.Store(snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/3000000"))))
		}()
		first, d := routeRepeat(t, tally, ctx, repeatTok)
		require.Equal(t, OutcomeReplicaWaited, d.Outcome)
		hctx, d := routeRepeat(t, tally, ctx, repeatTok)
		require.False(t, hctx == first)
		require.Equal(t, OutcomeReplica, d.Outcome)
	})
	t.Run("two databases", func(t *testing.T) {
		t.Parallel()
		r := unitRouter(t, snap(dbState("ci", 1, nil, rep("c1", 1, "0/3000000")), dbState("main", 1, nil, rep("r1", 1, "0/3000000"))),
			func(c *Config) { c.Now = func() time.Time { return t0 } })
		tally := r.NewTally()
		two := tok(time.Second, ent("ci", 1, "0/1"), ent("main", 1, "0/1"))
		first, _ := routeRepeat(t, tally, ctx, two)
		hctx, _ := routeRepeat(t, tally, ctx, two)
		require.False(t, hctx == first)
	})
}

// TestTallyRepeatTraced: a job in a trace gets its own route span, so it
// is always decided afresh.
func TestTallyRepeatTraced(t *testing.T) {
	t.Parallel()
	r, exp, tracer := tracedRouter(t, nil)
	tally := r.NewTally()
	parent, span := tracer.Start(context.Background(), "batch")
	defer span.End()
	first, _ := routeRepeat(t, tally, parent, tok(time.Second, ent("main", 1, "0/100")))
	hctx, _ := routeRepeat(t, tally, parent, tok(time.Second, ent("main", 1, "0/100")))
	require.False(t, hctx == first)
	require.Len(t, spantest.Named(exp, SpanRoute), 2)
}

// uncomparableCtx is a context whose values == cannot compare.
type uncomparableCtx struct {
	context.Context
	tags []string
}

// TestTallyRepeatUncomparableParent: a parent context of a type that ==
// cannot compare is never compared (it would panic).
func TestTallyRepeatUncomparableParent(t *testing.T) {
	t.Parallel()
	r, _, _ := repeatRouter(t)
	tally := r.NewTally()
	parent := uncomparableCtx{Context: context.Background(), tags: []string{"a"}}
	first, _ := routeRepeat(t, tally, parent, repeatTok)
	hctx, d := routeRepeat(t, tally, parent, repeatTok)
	require.False(t, hctx == first)
	require.Equal(t, OutcomeReplica, d.Outcome)
}

// TestTallyRepeatMonotonicClock: with the Router on time.Now, a repeat
// reads the time off the monotonic clock (Tally.repeatNow), and still
// judges the replica fresh at the moment it repeats: a repeat while the
// replica's observation is within the staleness bound gets the last job's
// context, one after it does not (and the job goes to the primary).
// Attempts the machine was too slow to tell apart are tried again.
func TestTallyRepeatMonotonicClock(t *testing.T) {
	t.Parallel()
	const bound = 100 * time.Millisecond
	ctx := context.Background()
	var reused, refused bool
	for attempt := 0; !reused || !refused; attempt++ {
		require.Less(t, attempt, 50, "no attempt told a fresh replica from a stale one (reused %v, refused %v)", reused, refused)
		observed := time.Now()
		fresh := func(r *replay.ReplicaState) { r.ObservedAt = observed }
		r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", fresh), rep("r2", 1, "0/3000000", fresh))), func(c *Config) {
			c.WaitBudget = -1
			c.Tracker.StalenessBound = bound
		})
		tally := r.NewTally()
		require.True(t, tally.monotonic, "a Router on time.Now")
		tk := position.Of(observed, ent("main", 1, "0/1000000"))
		job := Job{Token: tk, Policy: Sticky}
		first, d, err := tally.Route(ctx, job)
		require.NoError(t, err)
		if d.Outcome != OutcomeReplica {
			continue // stale already
		}
		if !refused && attempt%2 == 1 {
			time.Sleep(time.Until(observed.Add(bound + 5*time.Millisecond)))
		}
		before := time.Now()
		again, d2, err := tally.Route(ctx, job)
		require.NoError(t, err)
		after := time.Now()
		switch {
		case after.Before(observed.Add(bound)): // fresh throughout
			require.True(t, again == first, "a repeat while the replica is fresh gets the last job's context")
			reused = true
		case before.After(observed.Add(bound)): // stale throughout
			require.False(t, again == first, "a repeat after the replica went stale got the last job's context")
			require.Equal(t, OutcomePrimary, d2.Outcome, "the replica is stale: %s", d2.Reason)
			refused = true
		}
	}
}

// TestTallyRepeatCounts: repeated decisions of different shapes (another
// replica, a token from the future) are counted on their own series,
// exactly as the same jobs decided afresh (each in a parent context of
// its own, which no job repeats) by a twin Tally.
func TestTallyRepeatCounts(t *testing.T) {
	t.Parallel()
	newRouter := func() (*Router, *sdkmetric.ManualReader) {
		reader := sdkmetric.NewManualReader()
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
		return unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/5000000"))), func(c *Config) {
			c.Now = func() time.Time { return t0 }
			c.WaitBudget = -1
			c.MeterProvider = mp
		}), reader
	}
	both := tok(time.Second, ent("main", 1, "0/1000000"))
	onlyR2 := tok(time.Second, ent("main", 1, "0/4000000"))
	future := position.Of(t0.Add(time.Hour), ent("main", 1, "0/1000000"))
	var jobs []position.Token
	for _, tk := range []position.Token{both, onlyR2, both, future, onlyR2, future} {
		for range 5 {
			jobs = append(jobs, tk)
		}
	}
	ctx := context.Background()
	twin, twinReader := newRouter()
	tallied, talliedReader := newRouter()
	fresh, tally := twin.NewTally(), tallied.NewTally()
	type jobKey struct{}
	var lastCtx context.Context
	repeats := 0
	for i, tk := range jobs {
		_, want, err := fresh.Route(context.WithValue(ctx, jobKey{}, i), Job{Token: tk, Policy: Sticky})
		require.NoError(t, err)
		hctx, got, err := tally.Route(ctx, Job{Token: tk, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, want.Databases[0].Replica, got.Databases[0].Replica)
		require.Equal(t, want.ClockSkew > 0, got.ClockSkew > 0)
		if hctx == lastCtx {
			repeats++
		}
		lastCtx = hctx
	}
	require.Equal(t, len(jobs)-6, repeats, "every job but the first of each run repeats")
	fresh.Flush(ctx)
	tally.Flush(ctx)
	want, got := sums(t, twinReader), sums(t, talliedReader)
	require.NotEmpty(t, want["caughtup.consume.tokens.future"])
	require.Len(t, want["caughtup.consume.database.routes"], 2, "both replicas read")
	require.Equal(t, want, got)
}
