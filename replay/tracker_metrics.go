package replay

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// trackerMetrics are the tracker's own instruments: counters for what its
// merges detect (synchronous, so that the counts outlive Close) and gauges
// for the replica conditions that exclude a replica, registered by the
// tracker and unregistered when it closes.
type trackerMetrics struct {
	queries  metric.Int64Counter
	querySet metric.AddOption
	restarts metric.Int64Counter
	rejected metric.Int64Counter
	reg      metric.Registration

	// Attribute sets, built once: per database, per replica.
	replica    [][]metric.MeasurementOption
	impossible [][]metric.MeasurementOption
	superseded [][]metric.MeasurementOption
	primarySup []metric.MeasurementOption
	primary    []metric.MeasurementOption
}

// query counts one query the tracker sent.
func (m *trackerMetrics) query() { m.queries.Add(context.Background(), 1, m.querySet) }

// Values of caughtup.reason on caughtup.consume.tracker.observations.rejected
// and caughtup.result on caughtup.consume.replica.guard.connections.
const (
	rejectedImpossible = "impossible"
	rejectedSuperseded = "superseded"
)

func newTrackerMetrics(mp metric.MeterProvider, t *Tracker) (*trackerMetrics, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	m := &trackerMetrics{querySet: withSystem()}
	var err error
	if m.queries, err = meter.Int64Counter("caughtup.consume.tracker.queries",
		metric.WithUnit("{query}"),
		metric.WithDescription("Queries the tracker has sent; independent of the job rate except while jobs wait.")); err != nil {
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
		metric.WithDescription("Age of the replica's last replayed transaction while received WAL waits to be replayed; 0 once all received WAL is replayed."))
	if err != nil {
		return nil, err
	}
	staleness, err := meter.Float64ObservableGauge("caughtup.consume.tracker.staleness",
		metric.WithUnit("s"),
		metric.WithDescription("Age of the tracker's last successful observation of each node (no caughtup.replica: the primary)."))
	if err != nil {
		return nil, err
	}
	if m.restarts, err = meter.Int64Counter("caughtup.consume.replica.restarts",
		metric.WithUnit("{restart}"),
		metric.WithDescription("Replica restarts the tracker saw (a newer postmaster or startup process); each holds the replica behind until it replays what it had before.")); err != nil {
		return nil, err
	}
	if m.rejected, err = meter.Int64Counter("caughtup.consume.tracker.observations.rejected",
		metric.WithUnit("{observation}"),
		metric.WithDescription("Observations not merged: impossible ones (a replica ahead of its primary; the replica counts as unknown) and superseded ones (from an older incarnation or timeline).")); err != nil {
		return nil, err
	}
	diverged, err := meter.Int64ObservableGauge("caughtup.consume.replica.diverged",
		metric.WithUnit("{replica}"),
		metric.WithDescription("1 while the replica is a diverged standby (on an older timeline past its switchpoint): used for no job until rebuilt."))
	if err != nil {
		return nil, err
	}
	hold, err := meter.Int64ObservableGauge("caughtup.consume.replica.restart.hold",
		metric.WithUnit("By"),
		metric.WithDescription("WAL bytes a restarted replica must still replay before it is used again; 0 when not held."))
	if err != nil {
		return nil, err
	}

	snap := t.snapshot()
	for i := range snap.Databases {
		ds := &snap.Databases[i]
		var rep, imp, sup []metric.MeasurementOption
		for j := range ds.Replicas {
			base := []attribute.KeyValue{attribute.String(attrDatabase, ds.Name), attribute.String(attrReplica, ds.Replicas[j].Name)}
			rep = append(rep, withSystem(base...))
			imp = append(imp, withSystem(append(base, attribute.String(attrReason, rejectedImpossible))...))
			sup = append(sup, withSystem(append(base, attribute.String(attrReason, rejectedSuperseded))...))
		}
		m.replica = append(m.replica, rep)
		m.impossible = append(m.impossible, imp)
		m.superseded = append(m.superseded, sup)
		m.primary = append(m.primary, withSystem(attribute.String(attrDatabase, ds.Name)))
		m.primarySup = append(m.primarySup, withSystem(attribute.String(attrDatabase, ds.Name), attribute.String(attrReason, rejectedSuperseded)))
	}

	m.reg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		s := t.snapshot()
		now := t.cfg.Now()
		for i := range s.Databases {
			ds := &s.Databases[i]
			if !ds.Primary.ObservedAt.IsZero() {
				o.ObserveFloat64(staleness, now.Sub(ds.Primary.ObservedAt).Seconds(), m.primary[i])
			}
			for j := range ds.Replicas {
				r := &ds.Replicas[j]
				if !r.ObservedAt.IsZero() && j < len(m.replica[i]) {
					o.ObserveFloat64(staleness, now.Sub(r.ObservedAt).Seconds(), m.replica[i][j])
					if r.Err == nil && r.InRecovery {
						if r.LagKnown {
							o.ObserveInt64(lagBytes, int64(min(r.LagBytes, 1<<62)), m.replica[i][j])
						}
						o.ObserveFloat64(lagTime, r.TimeLag.Seconds(), m.replica[i][j])
					}
				}
				if r.Observations == 0 || j >= len(m.replica[i]) {
					continue
				}
				v := int64(0)
				if r.Diverged {
					v = 1
				}
				o.ObserveInt64(diverged, v, m.replica[i][j])
				o.ObserveInt64(hold, int64(min(r.Replayed.LSN.BytesBefore(r.RestartFloor), 1<<62)), m.replica[i][j])
			}
		}
		return nil
	}, diverged, hold, lagBytes, lagTime, staleness)
	if err != nil {
		return nil, err
	}
	return m, nil
}

func (m *trackerMetrics) close() {
	if m != nil && m.reg != nil {
		_ = m.reg.Unregister()
	}
}

func (m *trackerMetrics) replicaChange(db, idx int, ch replicaChange) {
	ctx := context.Background()
	if ch.restarted {
		m.restarts.Add(ctx, 1, m.replica[db][idx])
	}
	if ch.impossible {
		m.rejected.Add(ctx, 1, m.impossible[db][idx])
	}
	if ch.superseded {
		m.rejected.Add(ctx, 1, m.superseded[db][idx])
	}
}

func (m *trackerMetrics) primaryChange(db int, ch primaryChange) {
	if ch.superseded {
		m.rejected.Add(context.Background(), 1, m.primarySup[db])
	}
}
