package consume

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

func TestMetricSlots(t *testing.T) {
	t.Parallel()
	for i := range numOutcomes {
		require.Equal(t, i, outcomeSlot(Outcome(i)))
	}
	for i := range numReasons {
		require.Equal(t, i, reasonSlot(Reason(i)))
	}
	require.Equal(t, -1, outcomeSlot(Outcome(200)))
	require.Equal(t, -1, reasonSlot(Reason(200)))
	for v := range 256 {
		r := position.Incomparable(v)
		require.Equal(t, r.String(), position.Incomparable(incomparableSlot(r)).String(), v)
	}
}

// The handler's context for two databases must stay one allocation of
// at most the largest size without a malloc header (see newRouted).
func TestRoutedSize(t *testing.T) {
	t.Parallel()
	require.LessOrEqual(t, unsafe.Sizeof(routed{})+2*unsafe.Sizeof(DatabaseDecision{}), uintptr(512))
	for n := range 5 {
		rc, buf := newRouted(n)
		require.NotNil(t, rc)
		require.NotNil(t, buf)
		require.Empty(t, buf)
		require.GreaterOrEqual(t, cap(buf), n)
	}
}

// metricsTracker is a tracker that only publishes snap, for the metrics'
// layout and gauges.
func metricsTracker(s *Snapshot) *tracker {
	cfg := Config{}.WithDefaults()
	tr := &tracker{cfg: &cfg}
	s.changed = make(chan struct{})
	tr.snap.Store(s)
	return tr
}

// syncMetrics records decisions the way synchronous counters would (the
// implementation the observable counters replaced), as the reference.
type syncMetrics struct {
	decisions, routes, missing, crossEpoch metric.Int64Counter
	wait                                   metric.Float64Histogram
}

func newSyncMetrics(t *testing.T, mp metric.MeterProvider) *syncMetrics {
	meter := mp.Meter(ScopeName)
	m := &syncMetrics{}
	var err error
	m.decisions, err = meter.Int64Counter("caughtup.consume.decisions", metric.WithUnit("{decision}"),
		metric.WithDescription("Routing decisions per job, by policy, outcome and reason."))
	require.NoError(t, err)
	m.routes, err = meter.Int64Counter("caughtup.consume.database.routes", metric.WithUnit("{route}"),
		metric.WithDescription("Per-database routes of jobs that ran, by database, replica (absent: primary), outcome and reason."))
	require.NoError(t, err)
	m.missing, err = meter.Int64Counter("caughtup.consume.tokens.missing", metric.WithUnit("{token}"),
		metric.WithDescription("Jobs without a usable token (reason no_token or malformed_token); they read the primary."))
	require.NoError(t, err)
	m.crossEpoch, err = meter.Int64Counter("caughtup.consume.tokens.cross_epoch", metric.WithUnit("{token}"),
		metric.WithDescription("Token entries whose epoch cannot be compared with the replicas (reason: how); they read the primary."))
	require.NoError(t, err)
	m.wait, err = meter.Float64Histogram("caughtup.consume.wait.duration", metric.WithUnit("s"),
		metric.WithDescription("Time a job waited in process for a replica to catch up with its token."),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
	require.NoError(t, err)
	return m
}

func (m *syncMetrics) record(ctx context.Context, d *Decision, waited bool) {
	with := func(kv []attribute.KeyValue) metric.MeasurementOption {
		return metric.WithAttributes(append([]attribute.KeyValue{semconv.DBSystemNamePostgreSQL}, kv...)...)
	}
	job := with(decisionAttrs(d.Policy, d.Outcome, d.Reason))
	m.decisions.Add(ctx, 1, job)
	if waited {
		m.wait.Record(ctx, d.Waited.Seconds(), job)
	}
	if d.Outcome == OutcomePrimaryNoToken {
		m.missing.Add(ctx, 1, with([]attribute.KeyValue{attribute.String(attrReason, d.Reason.String())}))
	}
	for _, dd := range d.Databases {
		if dd.Reason == ReasonEpoch {
			m.crossEpoch.Add(ctx, 1, with(crossEpochAttrs(dd.Database, dd.Incomparable)))
		}
		if d.Action == ActionRun {
			m.routes.Add(ctx, 1, with(routeAttrs(dd.Database, dd.Replica, dd.Outcome, dd.Reason)))
		}
	}
}

// collected is a collection in comparable form: per instrument, its
// description and unit, and per attribute set its value (for a
// histogram, count and sum).
func collected(t *testing.T, r sdkmetric.Reader) map[string]map[string]string {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, r.Collect(context.Background(), &rm))
	out := map[string]map[string]string{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, ScopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			if strings.Contains(m.Name, ".tracker.") || strings.Contains(m.Name, ".replica.") {
				continue // the tracker's instruments
			}
			pts := map[string]string{"": m.Description + " " + m.Unit}
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				require.True(t, data.IsMonotonic, m.Name)
				require.Equal(t, metricdata.CumulativeTemporality, data.Temporality, m.Name)
				for _, dp := range data.DataPoints {
					pts[dp.Attributes.Encoded(attribute.DefaultEncoder())] = fmt.Sprint(dp.Value)
				}
			case metricdata.Histogram[float64]:
				for _, dp := range data.DataPoints {
					pts[dp.Attributes.Encoded(attribute.DefaultEncoder())] = fmt.Sprint(dp.Count, " ", dp.Sum)
				}
			default:
				t.Fatalf("%s: unexpected %T", m.Name, m.Data)
			}
			out[m.Name] = pts
		}
	}
	return out
}

// TestMetricsAsSynchronousCounters records random decisions, those Decide
// makes and odd ones that have no slot, and checks that a reader sees
// what synchronous counters would have shown.
func TestMetricsAsSynchronousCounters(t *testing.T) {
	t.Parallel()
	tr := metricsTracker(snap(
		dbState("ci", 1, nil),
		dbState("main", 1, nil, rep("r1", 1, "0/1"), rep("r2", 1, "0/1")),
	))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m, err := newMetrics(mp, tr)
	require.NoError(t, err)
	refReader := sdkmetric.NewManualReader()
	refMP := sdkmetric.NewMeterProvider(sdkmetric.WithReader(refReader))
	t.Cleanup(func() { _ = refMP.Shutdown(context.Background()) })
	ref := newSyncMetrics(t, refMP)

	rng := rand.New(rand.NewPCG(1, 2))
	var outcomes []Outcome
	for i := range numOutcomes + 1 {
		outcomes = append(outcomes, Outcome(i))
	}
	var reasons []Reason
	for i := range numReasons + 1 {
		reasons = append(reasons, Reason(i))
	}
	replicas := map[string][]string{"main": {"r1", "r2"}}
	ctx := context.Background()
	for round := range 3 {
		for range 2000 {
			d := Decision{
				Policy:  Policy(rng.IntN(len(policyNames) + 1)),
				Action:  Action(rng.IntN(len(actionNames))),
				Outcome: outcomes[rng.IntN(len(outcomes))],
				Reason:  reasons[rng.IntN(len(reasons))],
				Waited:  time.Duration(rng.IntN(1000)) * time.Millisecond,
			}
			if rng.IntN(4) == 0 {
				d.Outcome = OutcomePrimaryNoToken
			}
			for _, db := range []string{"main", "ci", "unknown"} {
				if rng.IntN(2) == 0 {
					continue
				}
				dd := DatabaseDecision{
					Database: db, replica: -1,
					Outcome:      outcomes[rng.IntN(len(outcomes))],
					Reason:       reasons[rng.IntN(len(reasons))],
					Incomparable: position.Incomparable(rng.IntN(8)),
				}
				if rng.IntN(3) == 0 {
					dd.Reason = ReasonEpoch
				}
				if reps := replicas[db]; len(reps) > 0 && rng.IntN(2) == 0 {
					dd.replica = int32(rng.IntN(len(reps)))
					dd.Replica = reps[dd.replica]
					if rng.IntN(10) == 0 {
						dd.Replica = "renamed" // no slot: counted all the same
					}
				}
				d.Databases = append(d.Databases, dd)
			}
			waited := rng.IntN(5) == 0
			m.record(ctx, &d, waited)
			ref.record(ctx, &d, waited)
		}
		got, want := collected(t, reader), collected(t, refReader)
		require.Equal(t, want, got, "round %d", round)
		require.Len(t, got, 5)
	}

	// The counts outlive Close, as a synchronous counter's do: the last
	// collection (MeterProvider.Shutdown) still reports them.
	before := collected(t, reader)
	require.NoError(t, m.reg.Unregister())
	after := collected(t, reader)
	for _, name := range []string{"caughtup.consume.decisions", "caughtup.consume.database.routes", "caughtup.consume.tokens.missing", "caughtup.consume.tokens.cross_epoch"} {
		require.Equal(t, before[name], after[name], name)
	}
}

func TestMetricsCountDecisions(t *testing.T) {
	t.Parallel()
	tr := metricsTracker(snap(dbState("main", 1, nil, rep("r1", 1, "0/1"), rep("r2", 1, "0/1"))))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m, err := newMetrics(mp, tr)
	require.NoError(t, err)

	for range 3 {
		m.record(context.Background(), &Decision{Policy: Delayed, Action: ActionRun, Outcome: OutcomeReplica, Reason: ReasonNone,
			Databases: []DatabaseDecision{{Database: "main", Replica: "r2", replica: 1, Outcome: OutcomeReplica, Reason: ReasonNone}}}, false)
	}
	m.record(context.Background(), &Decision{Policy: Sticky, Action: ActionRun, Outcome: OutcomePrimaryNoToken, Reason: ReasonNoToken}, false)
	got := collected(t, reader)
	require.Equal(t, map[string]string{
		"": "Routing decisions per job, by policy, outcome and reason. {decision}",
		"caughtup.outcome=replica,caughtup.policy=delayed,caughtup.reason=none,db.system.name=postgresql":             "3",
		"caughtup.outcome=primary_no_token,caughtup.policy=sticky,caughtup.reason=no_token,db.system.name=postgresql": "1",
	}, got["caughtup.consume.decisions"])
	require.Equal(t, map[string]string{
		"": "Per-database routes of jobs that ran, by database, replica (absent: primary), outcome and reason. {route}",
		"caughtup.database=main,caughtup.outcome=replica,caughtup.reason=none,caughtup.replica=r2,db.system.name=postgresql": "3",
	}, got["caughtup.consume.database.routes"])
	require.Equal(t, map[string]string{
		"": "Jobs without a usable token (reason no_token or malformed_token); they read the primary. {token}",
		"caughtup.reason=no_token,db.system.name=postgresql": "1",
	}, got["caughtup.consume.tokens.missing"])
	// Nothing until something is counted, as with a synchronous counter.
	require.NotContains(t, got, "caughtup.consume.tokens.cross_epoch")
}

// TestRoutedContext checks the handler's context against what
// context.WithValue and enqueue.WithToken gave before: values, the child
// token, cancellation and its text.
func TestRoutedContext(t *testing.T) {
	t.Parallel()
	tr := metricsTracker(snap(dbState("main", 1, nil, rep("r1", 1, "0/9000"))))
	r := &Router{cfg: *tr.cfg, tr: tr, pools: map[string]*Database{"main": {}}}
	r.cfg.WaitBudget = -1
	r.log = testLogger(t)
	var err error
	r.met, err = newMetrics(sdkmetric.NewMeterProvider(), tr)
	require.NoError(t, err)
	r.gate = &fallbackGate{lim: rate.NewLimiter(rate.Inf, 0)}
	r.cfg.Now = func() time.Time { return t0 }

	type key struct{}
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), key{}, "v"))
	jobTok := position.Of(t0.Add(-time.Second), ent("main", 1, "0/100"))
	hctx, d, err := r.RouteToken(parent, jobTok, Delayed)
	require.NoError(t, err)
	require.Equal(t, OutcomeReplica, d.Outcome)
	got, ok := DecisionFrom(hctx)
	require.True(t, ok)
	require.Equal(t, d, got)
	require.Equal(t, "v", hctx.Value(key{}))
	child, ok := enqueue.TokenFrom(hctx)
	require.True(t, ok)
	require.Equal(t, childToken(jobTok, &d, child.CapturedAt), child)
	require.Equal(t, []position.Entry{{Database: "main", Epoch: ep(1), LSN: lsn("0/9000"), Source: position.SourceReplica}}, child.Entries)
	require.Equal(t, "context.Background.WithValue(consume.key, v).WithCancel.WithValue(consume.routedKey, *consume.routed).WithValue(enqueue.tokenKey, *consume.childSource)",
		fmt.Sprint(hctx))

	// Derived contexts see the values and the cancellation.
	derived, stop := context.WithTimeout(hctx, time.Minute)
	defer stop()
	cancel()
	<-derived.Done()
	require.ErrorIs(t, derived.Err(), context.Canceled)
	require.ErrorIs(t, hctx.Err(), context.Canceled)
	_, ok = DecisionFrom(derived)
	require.True(t, ok)

	// No token: no child token, and the decision still travels.
	hctx, d, err = r.Route(context.Background(), "", Delayed)
	require.NoError(t, err)
	require.Equal(t, OutcomePrimaryNoToken, d.Outcome)
	_, ok = enqueue.TokenFrom(hctx)
	require.False(t, ok)
	_, ok = DecisionFrom(hctx)
	require.True(t, ok)
}
