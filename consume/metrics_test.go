package consume

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
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

// metricsDatabases configures ci without replicas and main with r1, r2.
var metricsDatabases = map[string]replay.Database{
	"ci":   {},
	"main": {Replicas: []replay.Replica{{Name: "r1"}, {Name: "r2"}}},
}

// syncMetrics records decisions into synchronous instruments with
// attributes built on every call, as the reference for the prebuilt sets.
type syncMetrics struct {
	decisions, routes, missing, crossEpoch, future metric.Int64Counter
	wait                                           metric.Float64Histogram
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
	m.future, err = meter.Int64Counter("caughtup.consume.tokens.future", metric.WithUnit("{token}"),
		metric.WithDescription("Jobs whose token was captured more than Config.ClockSkewTolerance ahead of the consumer's clock (producer clock ahead); their age counts as unknown, so they are not deferred."))
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
	if d.ClockSkew > 0 {
		m.future.Add(ctx, 1, with(nil))
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

// TestMetricsMatchPerCallAttributes records random decisions, those
// Decide makes and odd ones that have no prebuilt set, and checks that a
// reader sees what attributes built on every call would have shown.
func TestMetricsMatchPerCallAttributes(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m, err := newMetrics(mp, metricsDatabases)
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
						dd.Replica = "renamed" // no prebuilt set: counted all the same
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
}

func TestMetricsCountDecisions(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m, err := newMetrics(mp, metricsDatabases)
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

// TestMetricsContract pins what the README's Metrics table promises: each
// instrument's name, unit, kind and attribute names.
func TestMetricsContract(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	s := snap(dbState("main", 1, nil, rep("r1", 1, "0/1"), rep("r2", 1, "0/1")))
	s.Databases[0].Replicas[0].LagKnown = true
	r := unitRouter(t, s, func(c *Config) { c.MeterProvider = mp; c.Now = func() time.Time { return t0 } })
	ctx := context.Background()
	for _, d := range []Decision{
		{Policy: Delayed, Action: ActionRun, Outcome: OutcomeReplicaWaited, Waited: time.Millisecond,
			Databases: []DatabaseDecision{{Database: "main", Replica: "r1", replica: 0, Outcome: OutcomeReplicaWaited}}},
		{Policy: Sticky, Action: ActionRun, Outcome: OutcomePrimaryNoToken, Reason: ReasonNoToken},
		{Policy: Delayed, Action: ActionRun, Outcome: OutcomePrimary, Reason: ReasonUnknownAge, ClockSkew: time.Hour},
		{Policy: Sticky, Action: ActionRun, Outcome: OutcomePrimaryEpoch, Reason: ReasonEpoch,
			Databases: []DatabaseDecision{{Database: "main", replica: -1, Outcome: OutcomePrimaryEpoch, Reason: ReasonEpoch, Incomparable: position.OtherSystem}}},
	} {
		r.met.record(ctx, &d, d.Waited > 0)
	}

	type inst struct {
		unit, kind string
		keys       []string // every data point's attribute names, sorted, joined
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	got := map[string]inst{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, ScopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			in := inst{unit: m.Unit, kind: fmt.Sprintf("%T", m.Data)}
			var sets []attribute.Set
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				require.True(t, data.IsMonotonic, m.Name)
				for _, dp := range data.DataPoints {
					sets = append(sets, dp.Attributes)
				}
			case metricdata.Histogram[float64]:
				for _, dp := range data.DataPoints {
					sets = append(sets, dp.Attributes)
				}
			case metricdata.Gauge[int64]:
				for _, dp := range data.DataPoints {
					sets = append(sets, dp.Attributes)
				}
			case metricdata.Gauge[float64]:
				for _, dp := range data.DataPoints {
					sets = append(sets, dp.Attributes)
				}
			}
			for _, set := range sets {
				var keys []string
				for _, kv := range set.ToSlice() {
					keys = append(keys, string(kv.Key))
				}
				slices.Sort(keys)
				if k := strings.Join(keys, ","); !slices.Contains(in.keys, k) {
					in.keys = append(in.keys, k)
				}
			}
			slices.Sort(in.keys)
			got[m.Name] = in
		}
	}
	const (
		sum  = "metricdata.Sum[int64]"
		hist = "metricdata.Histogram[float64]"
	)
	require.Equal(t, map[string]inst{
		"caughtup.consume.decisions":          {"{decision}", sum, []string{"caughtup.outcome,caughtup.policy,caughtup.reason,db.system.name"}},
		"caughtup.consume.wait.duration":      {"s", hist, []string{"caughtup.outcome,caughtup.policy,caughtup.reason,db.system.name"}},
		"caughtup.consume.database.routes":    {"{route}", sum, []string{"caughtup.database,caughtup.outcome,caughtup.reason,caughtup.replica,db.system.name", "caughtup.database,caughtup.outcome,caughtup.reason,db.system.name"}},
		"caughtup.consume.tokens.missing":     {"{token}", sum, []string{"caughtup.reason,db.system.name"}},
		"caughtup.consume.tokens.cross_epoch": {"{token}", sum, []string{"caughtup.database,caughtup.reason,db.system.name"}},
		"caughtup.consume.tokens.future":      {"{token}", sum, []string{"db.system.name"}},
	}, got)
}

// gaugePoints is a collection's gauge data points per instrument; it
// fails on a series reported twice.
func gaugePoints(t *testing.T, reader sdkmetric.Reader) map[string]int {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]int{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			var sets []attribute.Set
			switch data := m.Data.(type) {
			case metricdata.Gauge[int64]:
				for _, dp := range data.DataPoints {
					sets = append(sets, dp.Attributes)
				}
			case metricdata.Gauge[float64]:
				for _, dp := range data.DataPoints {
					sets = append(sets, dp.Attributes)
				}
			default:
				continue
			}
			seen := map[attribute.Distinct]bool{}
			for _, s := range sets {
				require.False(t, seen[s.Equivalent()], "%s{%s} reported twice", m.Name, s.Encoded(attribute.DefaultEncoder()))
				seen[s.Equivalent()] = true
			}
			out[m.Name] = len(sets)
		}
	}
	return out
}

// TestMetricsAcrossRouters closes a router and makes another on the same
// MeterProvider, as a process that reconfigures does: the counts of the
// first survive its Close, the second adds to the same series, and every
// series, gauges included, is reported once.
func TestMetricsAcrossRouters(t *testing.T) {
	e := setup(t, pgtest.Shared(t))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	_, tok := e.write(t)
	ctx := ctxT(t)
	route := func(r *Router, n int) {
		for range n {
			_, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
			require.NoError(t, err)
			require.Equal(t, OutcomeReplica, d.Outcome)
		}
	}
	lagKnown := func(s *replay.Snapshot) bool {
		for _, rs := range s.Database("main").Replicas {
			if !rs.LagKnown {
				return false
			}
		}
		return true
	}
	const jobs = `caughtup.outcome=replica,caughtup.policy=sticky,caughtup.reason=none,db.system.name=postgresql`

	first, err := NewRouter(ctx, e.config(t, func(c *Config) { c.MeterProvider = mp }))
	require.NoError(t, err)
	seen(t, first, tok)
	waitUntil(t, first, "byte lag is known", lagKnown)
	route(first, 3)
	require.Equal(t, map[string]int{
		"caughtup.consume.replica.lag": 2, "caughtup.consume.replica.lag.time": 2, "caughtup.consume.tracker.staleness": 3,
		"caughtup.consume.replica.diverged": 2, "caughtup.consume.replica.restart.hold": 2,
	}, gaugePoints(t, reader))
	require.NoError(t, first.Close())

	// After Close: the last jobs are still reported (as at
	// MeterProvider.Shutdown); the gauges went with the tracker.
	got := sums(t, reader)
	require.Equal(t, map[string]int64{jobs: 3}, got["caughtup.consume.decisions"])
	require.Equal(t, int64(3), total(got["caughtup.consume.database.routes"]))
	queries := total(got["caughtup.consume.tracker.queries"])
	require.Positive(t, queries)
	require.Empty(t, gaugePoints(t, reader))

	second := e.router(t, func(c *Config) { c.MeterProvider = mp })
	seen(t, second, tok)
	waitUntil(t, second, "byte lag is known", lagKnown)
	route(second, 2)
	got = sums(t, reader) // fails on a series reported twice
	require.Equal(t, map[string]int64{jobs: 5}, got["caughtup.consume.decisions"])
	require.Equal(t, int64(5), total(got["caughtup.consume.database.routes"]))
	require.Len(t, got["caughtup.consume.tracker.queries"], 1)
	require.Greater(t, total(got["caughtup.consume.tracker.queries"]), queries, "the second tracker adds to the first's count")
	require.Equal(t, map[string]int{
		"caughtup.consume.replica.lag": 2, "caughtup.consume.replica.lag.time": 2, "caughtup.consume.tracker.staleness": 3,
		"caughtup.consume.replica.diverged": 2, "caughtup.consume.replica.restart.hold": 2,
	}, gaugePoints(t, reader))
}
