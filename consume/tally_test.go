package consume

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/replicapool"
)

// TestTally: jobs routed through a Tally get the Router's decisions, and
// their counts reach the same series as the Router's own, once flushed.
func TestTally(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"))), func(c *Config) {
		c.Now = func() time.Time { return t0 }
		c.WaitBudget = -1
		c.MeterProvider = mp
	})
	ctx := context.Background()
	caught := tok(time.Second, ent("main", 1, "0/1000000"))
	other := position.Of(t0, position.Entry{Database: "main", Epoch: position.Epoch{SystemID: 1, Timeline: 1}, LSN: 1})

	route := func(rd func(context.Context, Job) (context.Context, Decision, error)) {
		_, d, err := rd(ctx, Job{Token: caught, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, OutcomeReplica, d.Outcome)
		_, d, err = rd(ctx, Job{Token: position.Token{}, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, OutcomePrimaryNoToken, d.Outcome)
		_, d, err = rd(ctx, Job{Token: other, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, OutcomePrimaryEpoch, d.Outcome)
	}
	route(r.Route)
	direct := sums(t, reader)

	tally := r.NewTally()
	route(tally.Route)
	require.Equal(t, direct, sums(t, reader), "nothing added before Flush")
	tally.Flush(ctx)
	flushed := sums(t, reader)
	for _, name := range []string{"caughtup.consume.decisions", "caughtup.consume.database.routes",
		"caughtup.consume.tokens.missing", "caughtup.consume.tokens.cross_epoch"} {
		require.NotEmpty(t, direct[name], name)
		for k, v := range direct[name] {
			require.Equal(t, 2*v, flushed[name][k], "%s{%s}: the Tally's counts add to the same series", name, k)
		}
	}
	tally.Flush(ctx)
	require.Equal(t, flushed, sums(t, reader), "a second Flush adds nothing")
}

// TestTallyConcurrent: workers routing through one Tally while another
// goroutine flushes it lose and double no count, however their decisions
// alternate (more attribute sets than the Tally keeps at hand).
func TestTallyConcurrent(t *testing.T) {
	t.Parallel()
	s := func() *replay.Snapshot {
		return snap(dbState("ci", 1, nil), dbState("main", 1, nil, rep("r1", 1, "0/3000000")))
	}
	newRouter := func() (*Router, *sdkmetric.ManualReader) {
		reader := sdkmetric.NewManualReader()
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
		return unitRouter(t, s(), func(c *Config) {
			c.Now = func() time.Time { return t0 }
			c.WaitBudget = -1
			c.MeterProvider = mp
		}), reader
	}
	type job struct {
		tok    position.Token
		policy Policy
	}
	jobs := []job{
		{tok(time.Second, ent("main", 1, "0/1000000")), Delayed},
		{position.Token{}, Delayed},
		{position.Of(t0, position.Entry{Database: "main", Epoch: position.Epoch{SystemID: 1, Timeline: 1}, LSN: 1}), Delayed},
		{tok(time.Second, ent("ci", 1, "0/1")), Sticky},
		{tok(time.Second, ent("main", 1, "0/1000000")), Always},
		{tok(time.Second, ent("ci", 1, "0/1"), ent("main", 1, "0/1000000")), Sticky},
	}
	const workers, perWorker = 4, 3000
	ctx := context.Background()

	direct, directReader := newRouter()
	for w := range workers {
		for i := range perWorker {
			j := jobs[(w+i)%len(jobs)]
			_, _, err := direct.Route(ctx, Job{Token: j.tok, TokenErr: nil, Policy: j.policy})
			require.NoError(t, err)
		}
	}

	tallied, talliedReader := newRouter()
	tally := tallied.NewTally()
	stop := make(chan struct{})
	flushed := make(chan struct{})
	go func() {
		defer close(flushed)
		for {
			select {
			case <-stop:
				return
			default:
				tally.Flush(ctx)
			}
		}
	}()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				j := jobs[(w+i)%len(jobs)]
				if _, _, err := tally.Route(ctx, Job{Token: j.tok, TokenErr: nil, Policy: j.policy}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	<-flushed
	tally.Flush(ctx)
	require.Equal(t, sums(t, directReader), sums(t, talliedReader))
}

var slabSink []*routedSlab

// TestRoutedSlabFillsSizeClass: a Tally's batch of contexts leaves less
// than one context's bytes of its allocation unused, so that routedBatch
// is retuned when a field changes the contexts' size (a batch of 8 left
// 312 of 2688 bytes unused when DatabaseDecision grew to 128 bytes).
// Memory, not time: the runtime counts the size class it allocated.
func TestRoutedSlabFillsSizeClass(t *testing.T) {
	const n = 4096
	slabSink = make([]*routedSlab, 0, n)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		slabSink = append(slabSink, &routedSlab{})
	}
	runtime.ReadMemStats(&after)
	slabSink = nil
	perSlab := (after.TotalAlloc - before.TotalAlloc) / n
	size, item := unsafe.Sizeof(routedSlab{}), unsafe.Sizeof(routedOne{})
	t.Logf("%d contexts of %d bytes: %d bytes, allocated %d (%d per job)", routedBatch, item, size, perSlab, perSlab/routedBatch)
	require.Less(t, perSlab, uint64(size+item),
		"a batch of %d contexts of %d bytes (%d bytes) takes %d: set routedBatch so that the batch fills its size class", routedBatch, item, size, perSlab)
}

// BenchmarkTallyRoute is what a Kafka consumer's worker spends routing one
// message, without I/O: each job carries a token of its own (4096 of them,
// caught up on both replicas), routed through a Tally with the real clock,
// and the handler asks for its pool. The snapshot is fixed (unitRouter),
// so that the figure, and cachegrind's instruction count under
// GOMAXPROCS=1, is the routing's alone.
func BenchmarkTallyRoute(b *testing.B) {
	r, toks := tallyBenchRouter(b)
	tally := r.NewTally()
	ctx := context.Background()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if err := routeCaughtUp(tally, toks[i%len(toks)]); err != nil {
			b.Fatal(err)
		}
		i++
	}
	b.StopTimer()
	tally.Flush(ctx)
}

// BenchmarkTallyRouteSameToken is BenchmarkTallyRoute with one token for
// every job, as the messages of one transaction or of an outbox batch
// carry: the jobs after the first repeat its decision (Tally.repeat).
func BenchmarkTallyRouteSameToken(b *testing.B) {
	r, toks := tallyBenchRouter(b)
	tally := r.NewTally()
	b.ReportAllocs()
	for b.Loop() {
		if err := routeCaughtUp(tally, toks[0]); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	tally.Flush(context.Background())
}

// BenchmarkTallyRouteParallel is BenchmarkTallyRoute from one worker
// per core, each with its own Tally, as a Kafka Consumer's partitions
// route: what the workers share (the Router, its spread counter) costs
// here and not in BenchmarkTallyRoute.
func BenchmarkTallyRouteParallel(b *testing.B) {
	r, toks := tallyBenchRouter(b)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		tally := r.NewTally()
		i := 0
		for pb.Next() {
			if err := routeCaughtUp(tally, toks[i%len(toks)]); err != nil {
				b.Error(err) // not Fatal: this is not the benchmark's goroutine
				return
			}
			i++
		}
		tally.Flush(context.Background())
	})
}

// BenchmarkRouterRoute is BenchmarkTallyRoute through the Router itself,
// as the asynq, River and net/http adapters route: each job's counts go
// to the MeterProvider at once. With the global (no-op) provider, and
// with an SDK one, whose two Adds a job (decisions, database.routes) are
// the difference: attribute sets are built once per shape (metrics.go),
// but the SDK (v1.47) still walks each set's attributes on every Add
// (attrnorm.SetDedup) and looks its series up.
func BenchmarkRouterRoute(b *testing.B) {
	for _, bc := range []struct {
		name string
		mp   func(*testing.B) metric.MeterProvider
	}{
		{"noop-meter", func(*testing.B) metric.MeterProvider { return noop.NewMeterProvider() }},
		{"sdk-meter", func(b *testing.B) metric.MeterProvider {
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			b.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
			return mp
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			r, toks := tallyBenchRouter(b, func(c *Config) { c.MeterProvider = bc.mp(b) })
			ctx := context.Background()
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				hctx, d, err := r.Route(ctx, Job{Token: toks[i%len(toks)], Policy: Delayed})
				if err != nil || d.Outcome != OutcomeReplica {
					b.Fatal(d.Outcome, err)
				}
				if _, err := Pool(hctx, "main"); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// tallyBenchRouter is a Router whose two replicas have caught up with
// every one of the tokens, which differ in their positions.
func tallyBenchRouter(b *testing.B, mods ...func(*Config)) (*Router, []position.Token) {
	now := time.Now()
	fresh := func(r *replay.ReplicaState) { r.ObservedAt = now }
	r := unitRouter(b, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", fresh), rep("r2", 1, "0/3000000", fresh))),
		append([]func(*Config){func(c *Config) { c.Tracker.StalenessBound = 24 * time.Hour }}, mods...)...)
	toks := make([]position.Token, 4096)
	for i := range toks {
		toks[i] = position.Of(now, ent("main", 1, "0/2000000"))
		toks[i].Entries[0].LSN -= position.LSN(i)
	}
	return r, toks
}

// routeCaughtUp routes tok through tally, which must send it to a
// replica, and gets the handler's pool.
func routeCaughtUp(tally *Tally, tok position.Token) error {
	hctx, d, err := tally.Route(context.Background(), Job{Token: tok, TokenErr: nil, Policy: Delayed})
	if err != nil {
		return err
	}
	if d.Outcome != OutcomeReplica {
		return fmt.Errorf("routed to %s, not a replica", d.Outcome)
	}
	_, err = Pool(hctx, "main")
	return err
}

// TestTallySpread: a Tally's jobs all read the same caught-up replica and
// the next Tally's the other one, whatever the tokens, while jobs routed
// without a Tally alternate; a Tally whose replica is behind a token
// reads one that is not.
func TestTallySpread(t *testing.T) {
	t.Parallel()
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/2000000"))), func(c *Config) {
		c.Now = func() time.Time { return t0 }
		c.WaitBudget = -1
	})
	ctx := context.Background()
	replica := func(route func(context.Context, Job) (context.Context, Decision, error), at string) string {
		t.Helper()
		_, d, err := route(ctx, Job{Token: tok(time.Second, ent("main", 1, at)), Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, OutcomeReplica, d.Outcome)
		return d.Databases[0].Replica
	}
	a, b := r.NewTally(), r.NewTally()
	homes := map[string]bool{}
	for _, tl := range []*Tally{a, b} {
		first := replica(tl.Route, "0/1000000")
		for i := range 10 {
			require.Equal(t, first, replica(tl.Route, fmt.Sprintf("0/%X", 0x1000000+i)), "a Tally's jobs stay on its replica")
		}
		homes[first] = true
	}
	require.Len(t, homes, 2, "two Tallies share the two replicas out")
	direct := map[string]int{}
	for i := range 10 {
		direct[replica(r.Route, fmt.Sprintf("0/%X", 0x1000000+i))]++
	}
	require.Equal(t, map[string]int{"r1": 5, "r2": 5}, direct, "jobs without a Tally alternate")
	for _, tl := range []*Tally{a, b} {
		require.Equal(t, "r1", replica(tl.Route, "0/2800000"), "only r1 has replayed the token")
	}
}

// TestTallyCountsConnections: the checks of replica connections acquired
// for a job routed through a Tally are counted in it until Flush, those of
// a job the Router routed itself at once, both on the same series.
func TestTallyCountsConnections(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"))), func(c *Config) {
		c.Now = func() time.Time { return t0 }
		c.WaitBudget = -1
		c.MeterProvider = mp
	})
	other := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"))), func(c *Config) {
		c.Now = func() time.Time { return t0 }
		c.WaitBudget = -1
	})
	ctx := context.Background()
	job := Job{Token: tok(time.Second, ent("main", 1, "0/1000000")), Policy: Sticky}
	tally := r.NewTally()
	tallied, _, err := tally.Route(ctx, job)
	require.NoError(t, err)
	direct, _, err := r.Route(ctx, job)
	require.NoError(t, err)
	foreign, _, err := other.NewTally().Route(ctx, job)
	require.NoError(t, err)
	events := poolEvents{r: r, db: "main", replica: "r1"}
	const sameServer = "caughtup.result=same_server,db.system.name=postgresql"
	connections := func() int64 { return sums(t, reader)["caughtup.consume.replica.connections"][sameServer] }
	events.Checked(tallied, replicapool.CheckSameServer)
	events.Checked(tallied, replicapool.CheckSameServer)
	require.Zero(t, connections(), "a Tally's job's checks wait for Flush")
	events.Checked(direct, replicapool.CheckSameServer)
	events.Checked(foreign, replicapool.CheckSameServer)
	events.Checked(ctx, replicapool.CheckSameServer)
	require.Equal(t, int64(3), connections(), "checks of jobs this Router routed itself, or no Tally of it did, count at once")
	tally.Flush(ctx)
	require.Equal(t, int64(5), connections())
	tally.Flush(ctx)
	require.Equal(t, int64(5), connections(), "a second Flush adds nothing")
}

// TestTallyCountsByShape: a Tally counts a decision on the slots it found
// for the last decision of the same shape (Tally.count). Decisions that
// differ from the one before in one field at a time, every field that
// names an attribute included, are counted as attributes built on every
// call count them: a shape that left out a field would count such a
// decision on its neighbour's series.
func TestTallyCountsByShape(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := unitRouter(t, snap(dbState("ci", 1, nil), dbState("main", 1, nil, rep("r1", 1, "0/100"), rep("r2", 1, "0/100"))),
		func(c *Config) { c.MeterProvider = mp })
	tally := r.NewTally()
	refReader := sdkmetric.NewManualReader()
	refMP := sdkmetric.NewMeterProvider(sdkmetric.WithReader(refReader))
	t.Cleanup(func() { _ = refMP.Shutdown(context.Background()) })
	ref := newSyncMetrics(t, refMP)

	rng := rand.New(rand.NewPCG(7, 11))
	replicas := []string{"", "r1", "r2", "renamed"}
	d := Decision{Policy: Sticky, Action: ActionRun, Outcome: OutcomeReplica, Reason: ReasonNone,
		Databases: []DatabaseDecision{{Database: "main", Replica: "r1", replica: 0, Outcome: OutcomeReplica, Reason: ReasonNone}}}
	changes := []func(){
		func() { d.Policy = Policy(1 + rng.IntN(len(policyNames)-1)) },
		func() { d.Action = Action(rng.IntN(len(actionNames))) },
		func() { d.Outcome = Outcome(rng.IntN(numOutcomes)) },
		func() { d.Reason = Reason(rng.IntN(numReasons)) },
		func() { d.ClockSkew = time.Duration(rng.IntN(2)) * time.Hour },
		func() { d.TokenAge = time.Duration(rng.IntN(1000)) * time.Millisecond }, // no attribute
		func() {
			switch rng.IntN(4) {
			case 0:
				d.Databases = nil
			case 1:
				d.Databases = []DatabaseDecision{{Database: "main", replica: -1}, {Database: "ci", replica: -1, Reason: ReasonEpoch}}
			default:
				d.Databases = []DatabaseDecision{{Database: "main", replica: -1}}
			}
		},
	}
	one := []func(dd *DatabaseDecision){
		func(dd *DatabaseDecision) { dd.Database = []string{"main", "ci", "unknown"}[rng.IntN(3)] },
		func(dd *DatabaseDecision) {
			dd.replica = int32(rng.IntN(len(replicas))) - 1
			dd.Replica = replicas[dd.replica+1]
		},
		func(dd *DatabaseDecision) { dd.replica = int32(rng.IntN(3)) - 1 }, // the index alone
		func(dd *DatabaseDecision) { dd.Outcome = Outcome(rng.IntN(numOutcomes)) },
		func(dd *DatabaseDecision) { dd.Reason = Reason(rng.IntN(numReasons)) },
		func(dd *DatabaseDecision) { dd.Incomparable = position.Incomparable(rng.IntN(5)) },
	}
	ctx := context.Background()
	for i := range 20000 {
		// Each job gets a decision of its own, as Route's are.
		d.Databases = slices.Clone(d.Databases)
		if n := rng.IntN(len(changes) + len(one)); n < len(changes) {
			changes[n]()
		} else if len(d.Databases) == 1 {
			one[n-len(changes)](&d.Databases[0])
		}
		for range 1 + rng.IntN(3) {
			tally.count(&d)
			ref.record(ctx, &d, false)
		}
		if i%5000 == 4999 {
			tally.Flush(ctx)
			require.Equal(t, collected(t, refReader), collected(t, reader), "after %d decisions", i+1)
		}
	}
}
