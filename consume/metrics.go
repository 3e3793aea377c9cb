package consume

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of every instrument this package
// creates.
const ScopeName = "github.com/caughtup/caughtup/consume"

// Attribute names on metrics and log fields, besides db.system.name.
const (
	attrPolicy   = "caughtup.policy"
	attrOutcome  = "caughtup.outcome"
	attrReason   = "caughtup.reason"
	attrDatabase = "caughtup.database"
	attrReplica  = "caughtup.replica"
)

type metrics struct {
	decisions  metric.Int64Counter
	routes     metric.Int64Counter
	wait       metric.Float64Histogram
	missing    metric.Int64Counter
	crossEpoch metric.Int64Counter
	reg        metric.Registration

	// Attribute sets are built once per combination: the set of policies,
	// outcomes, reasons, databases and replicas is small and fixed.
	sets sync.Map // any key → metric.MeasurementOption
}

func newMetrics(mp metric.MeterProvider, tr *tracker) (*metrics, error) {
	m := &metrics{}
	meter := mp.Meter(ScopeName)
	var err error
	if m.decisions, err = meter.Int64Counter("caughtup.consume.decisions",
		metric.WithUnit("{decision}"),
		metric.WithDescription("Routing decisions per job, by policy, outcome and reason.")); err != nil {
		return nil, err
	}
	if m.routes, err = meter.Int64Counter("caughtup.consume.database.routes",
		metric.WithUnit("{route}"),
		metric.WithDescription("Per-database routes of jobs that ran, by database, replica (absent: primary), outcome and reason.")); err != nil {
		return nil, err
	}
	if m.wait, err = meter.Float64Histogram("caughtup.consume.wait.duration",
		metric.WithUnit("s"),
		metric.WithDescription("Time a job waited in process for a replica to catch up with its token."),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)); err != nil {
		return nil, err
	}
	if m.missing, err = meter.Int64Counter("caughtup.consume.tokens.missing",
		metric.WithUnit("{token}"),
		metric.WithDescription("Jobs without a usable token (reason no_token or malformed_token); they read the primary.")); err != nil {
		return nil, err
	}
	if m.crossEpoch, err = meter.Int64Counter("caughtup.consume.tokens.cross_epoch",
		metric.WithUnit("{token}"),
		metric.WithDescription("Token entries whose epoch cannot be compared with the replicas (reason: how); they read the primary.")); err != nil {
		return nil, err
	}
	lagBytes, err := meter.Int64ObservableGauge("caughtup.consume.replica.lag",
		metric.WithUnit("By"),
		metric.WithDescription("WAL bytes between the primary's insert position and the replica's replay, as last observed."))
	if err != nil {
		return nil, err
	}
	lagTime, err := meter.Float64ObservableGauge("caughtup.consume.replica.lag.time",
		metric.WithUnit("s"),
		metric.WithDescription("Age of the replica's last replayed transaction; grows on an idle primary, so alert on it only with byte lag."))
	if err != nil {
		return nil, err
	}
	staleness, err := meter.Float64ObservableGauge("caughtup.consume.tracker.staleness",
		metric.WithUnit("s"),
		metric.WithDescription("Age of the tracker's last successful observation of each node (no caughtup.replica: the primary)."))
	if err != nil {
		return nil, err
	}
	queries, err := meter.Int64ObservableCounter("caughtup.consume.tracker.queries",
		metric.WithUnit("{query}"),
		metric.WithDescription("Queries the tracker has sent; independent of the job rate except while jobs wait."))
	if err != nil {
		return nil, err
	}
	system := semconv.DBSystemNamePostgreSQL
	m.reg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		s := tr.snapshot()
		now := tr.cfg.Now()
		o.ObserveInt64(queries, int64(tr.queries.Load()), metric.WithAttributes(system))
		for i := range s.Databases {
			ds := &s.Databases[i]
			db := attribute.String(attrDatabase, ds.Name)
			if !ds.Primary.ObservedAt.IsZero() {
				o.ObserveFloat64(staleness, now.Sub(ds.Primary.ObservedAt).Seconds(), metric.WithAttributes(system, db))
			}
			for j := range ds.Replicas {
				r := &ds.Replicas[j]
				if r.ObservedAt.IsZero() {
					continue
				}
				attrs := metric.WithAttributes(system, db, attribute.String(attrReplica, r.Name))
				o.ObserveFloat64(staleness, now.Sub(r.ObservedAt).Seconds(), attrs)
				if r.Err != nil || !r.InRecovery {
					continue
				}
				if r.LagKnown {
					o.ObserveInt64(lagBytes, int64(min(r.LagBytes, 1<<62)), attrs)
				}
				o.ObserveFloat64(lagTime, r.TimeLag.Seconds(), attrs)
			}
		}
		return nil
	}, lagBytes, lagTime, staleness, queries)
	if err != nil {
		return nil, err
	}
	return m, nil
}

type decisionKey struct {
	p Policy
	o Outcome
	r Reason
}

type routeKey struct {
	db, replica string
	o           Outcome
	r           Reason
}

type epochKey struct {
	db string
	r  string
}

func (m *metrics) set(key any, build func() []attribute.KeyValue) metric.MeasurementOption {
	if v, ok := m.sets.Load(key); ok {
		return v.(metric.MeasurementOption)
	}
	kv := append([]attribute.KeyValue{semconv.DBSystemNamePostgreSQL}, build()...)
	opt := metric.WithAttributeSet(attribute.NewSet(kv...))
	m.sets.Store(key, opt)
	return opt
}

func (m *metrics) record(ctx context.Context, d *Decision, waited bool) {
	jobAttrs := m.set(decisionKey{d.Policy, d.Outcome, d.Reason}, func() []attribute.KeyValue {
		return []attribute.KeyValue{
			attribute.String(attrPolicy, d.Policy.String()),
			attribute.String(attrOutcome, string(d.Outcome)),
			attribute.String(attrReason, string(d.Reason)),
		}
	})
	m.decisions.Add(ctx, 1, jobAttrs)
	if waited {
		m.wait.Record(ctx, d.Waited.Seconds(), jobAttrs)
	}
	if d.Outcome == OutcomePrimaryNoToken {
		m.missing.Add(ctx, 1, m.set(d.Reason, func() []attribute.KeyValue {
			return []attribute.KeyValue{attribute.String(attrReason, string(d.Reason))}
		}))
	}
	for i := range d.Databases {
		dd := &d.Databases[i]
		if dd.Reason == ReasonEpoch {
			m.crossEpoch.Add(ctx, 1, m.set(epochKey{dd.Database, dd.Incomparable.String()}, func() []attribute.KeyValue {
				return []attribute.KeyValue{
					attribute.String(attrDatabase, dd.Database),
					attribute.String(attrReason, dd.Incomparable.String()),
				}
			}))
		}
		if d.Action != ActionRun {
			continue
		}
		m.routes.Add(ctx, 1, m.set(routeKey{dd.Database, dd.Replica, dd.Outcome, dd.Reason}, func() []attribute.KeyValue {
			kv := []attribute.KeyValue{
				attribute.String(attrDatabase, dd.Database),
				attribute.String(attrOutcome, string(dd.Outcome)),
				attribute.String(attrReason, string(dd.Reason)),
			}
			if dd.Replica != "" {
				kv = append(kv, attribute.String(attrReplica, dd.Replica))
			}
			return kv
		}))
	}
}
