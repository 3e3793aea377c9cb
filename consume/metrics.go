package consume

import (
	"context"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/caughtup/caughtup/position"
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

// The decision counters are observable counters over atomics: Route adds
// one to a slot indexed by the decision's policy, outcome and reason (and
// per database by replica), all small fixed sets, and a callback reports
// the slots. A synchronous counter costs an SDK call with an attribute
// lookup per job, about half of Route. Data points are the same: a
// monotonic Sum per attribute set that has been counted.
//
// The counts outlive the Router, as a synchronous counter's would: the
// callback stays registered after Close, so the collection that usually
// follows it (MeterProvider.Shutdown) still sees the last jobs. It holds
// only the counts, not the Router.
type metrics struct {
	wait  metric.Float64Histogram
	reg   metric.Registration // the gauges, which need the tracker
	insts [numInstruments]metric.Int64ObservableCounter

	decisions counterSet // policy × outcome × reason
	missing   counterSet // reason
	dbNames   []string   // as in Snapshot.Databases
	dbs       []dbCounters

	// mu guards the counterSets' options and other, which counts what has
	// no slot (a database the router does not know), so nothing is
	// dropped.
	mu    sync.Mutex
	other map[otherKey]*otherCount
}

type dbCounters struct {
	replicas   []string   // Config order; slot 0 is the primary
	routes     counterSet // (1 + replica) × outcome × reason
	crossEpoch counterSet // position.Incomparable
}

const (
	instDecisions = iota
	instRoutes
	instMissing
	instCrossEpoch
	numInstruments
)

// counterSet counts one instrument for a fixed list of attribute sets.
type counterSet struct {
	n     []atomic.Int64
	attrs func(slot int) []attribute.KeyValue // without db.system.name
	opts  []metric.MeasurementOption          // built when first needed, under metrics.mu
}

func newCounterSet(n int, attrs func(slot int) []attribute.KeyValue) counterSet {
	return counterSet{n: make([]atomic.Int64, n), attrs: attrs, opts: make([]metric.MeasurementOption, n)}
}

// option returns the attributes of slot; m.mu must be held.
func (c *counterSet) option(slot int) metric.MeasurementOption {
	if c.opts[slot] == nil {
		c.opts[slot] = withSystem(c.attrs(slot)...)
	}
	return c.opts[slot]
}

func (c *counterSet) observe(o metric.Observer, inst metric.Int64ObservableCounter) {
	for i := range c.n {
		if v := c.n[i].Load(); v > 0 {
			o.ObserveInt64(inst, v, c.option(i))
		}
	}
}

type otherKey struct {
	inst  int
	attrs attribute.Distinct
}

type otherCount struct {
	n   int64
	opt metric.MeasurementOption
}

func withSystem(kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(systemSet(kv))
}

func systemSet(kv []attribute.KeyValue) attribute.Set {
	return attribute.NewSet(append([]attribute.KeyValue{semconv.DBSystemNamePostgreSQL}, kv...)...)
}

const (
	numPolicies     = len(policyNames)
	numIncomparable = int(position.PastSwitchpoint) + 1
)

// outcomeSlot numbers o; -1 for anything else.
func outcomeSlot(o Outcome) int {
	if int(o) < numOutcomes {
		return int(o)
	}
	return -1
}

// reasonSlot numbers r; -1 for anything else.
func reasonSlot(r Reason) int {
	if int(r) < numReasons {
		return int(r)
	}
	return -1
}

// incomparableSlot numbers r by value; values String calls "comparable"
// share Comparable's slot.
func incomparableSlot(r position.Incomparable) int {
	if int(r) >= numIncomparable {
		return int(position.Comparable)
	}
	return int(r)
}

func decisionAttrs(p Policy, o Outcome, r Reason) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String(attrPolicy, p.String()),
		attribute.String(attrOutcome, o.String()),
		attribute.String(attrReason, r.String()),
	}
}

func routeAttrs(database, replica string, o Outcome, r Reason) []attribute.KeyValue {
	kv := []attribute.KeyValue{
		attribute.String(attrDatabase, database),
		attribute.String(attrOutcome, o.String()),
		attribute.String(attrReason, r.String()),
	}
	if replica != "" {
		kv = append(kv, attribute.String(attrReplica, replica))
	}
	return kv
}

func crossEpochAttrs(database string, r position.Incomparable) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String(attrDatabase, database),
		attribute.String(attrReason, r.String()),
	}
}

func newMetrics(mp metric.MeterProvider, tr *tracker) (*metrics, error) {
	m := &metrics{other: make(map[otherKey]*otherCount)}
	meter := mp.Meter(ScopeName)
	var err error
	if m.insts[instDecisions], err = meter.Int64ObservableCounter("caughtup.consume.decisions",
		metric.WithUnit("{decision}"),
		metric.WithDescription("Routing decisions per job, by policy, outcome and reason.")); err != nil {
		return nil, err
	}
	if m.insts[instRoutes], err = meter.Int64ObservableCounter("caughtup.consume.database.routes",
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
	if m.insts[instMissing], err = meter.Int64ObservableCounter("caughtup.consume.tokens.missing",
		metric.WithUnit("{token}"),
		metric.WithDescription("Jobs without a usable token (reason no_token or malformed_token); they read the primary.")); err != nil {
		return nil, err
	}
	if m.insts[instCrossEpoch], err = meter.Int64ObservableCounter("caughtup.consume.tokens.cross_epoch",
		metric.WithUnit("{token}"),
		metric.WithDescription("Token entries whose epoch cannot be compared with the replicas (reason: how); they read the primary.")); err != nil {
		return nil, err
	}

	m.decisions = newCounterSet(numPolicies*numOutcomes*numReasons, func(slot int) []attribute.KeyValue {
		return decisionAttrs(Policy(slot/(numOutcomes*numReasons)), Outcome(slot/numReasons%numOutcomes), Reason(slot%numReasons))
	})
	m.missing = newCounterSet(numReasons, func(slot int) []attribute.KeyValue {
		return []attribute.KeyValue{attribute.String(attrReason, Reason(slot).String())}
	})
	for _, ds := range tr.snapshot().Databases {
		dc := dbCounters{replicas: make([]string, len(ds.Replicas))}
		for j := range ds.Replicas {
			dc.replicas[j] = ds.Replicas[j].Name
		}
		name := ds.Name
		dc.routes = newCounterSet((1+len(dc.replicas))*numOutcomes*numReasons, func(slot int) []attribute.KeyValue {
			replica := ""
			if j := slot / (numOutcomes * numReasons); j > 0 {
				replica = dc.replicas[j-1]
			}
			return routeAttrs(name, replica, Outcome(slot/numReasons%numOutcomes), Reason(slot%numReasons))
		})
		dc.crossEpoch = newCounterSet(numIncomparable, func(slot int) []attribute.KeyValue {
			return crossEpochAttrs(name, position.Incomparable(slot))
		})
		m.dbNames = append(m.dbNames, name)
		m.dbs = append(m.dbs, dc)
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
	counters := make([]metric.Observable, len(m.insts))
	for i, c := range m.insts {
		counters[i] = c
	}
	if _, err = meter.RegisterCallback(m.observe, counters...); err != nil {
		_ = m.reg.Unregister()
		return nil, err
	}
	return m, nil
}

func (m *metrics) observe(_ context.Context, o metric.Observer) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.decisions.observe(o, m.insts[instDecisions])
	m.missing.observe(o, m.insts[instMissing])
	for i := range m.dbs {
		m.dbs[i].routes.observe(o, m.insts[instRoutes])
		m.dbs[i].crossEpoch.observe(o, m.insts[instCrossEpoch])
	}
	for k, c := range m.other {
		o.ObserveInt64(m.insts[k.inst], c.n, c.opt)
	}
	return nil
}

// addOther counts what has no slot.
func (m *metrics) addOther(inst int, kv []attribute.KeyValue) {
	set := systemSet(kv)
	k := otherKey{inst, set.Equivalent()}
	m.mu.Lock()
	c := m.other[k]
	if c == nil {
		c = &otherCount{opt: metric.WithAttributeSet(set)}
		m.other[k] = c
	}
	c.n++
	m.mu.Unlock()
}

// database returns the index of a database in dbNames, or -1.
func (m *metrics) database(name string) int {
	for i, n := range m.dbNames {
		if n == name {
			return i
		}
	}
	return -1
}

func (m *metrics) record(ctx context.Context, d *Decision, waited bool) {
	job := -1
	if o, r := outcomeSlot(d.Outcome), reasonSlot(d.Reason); d.Policy.valid() && o >= 0 && r >= 0 {
		job = (int(d.Policy)*numOutcomes+o)*numReasons + r
		m.decisions.n[job].Add(1)
	} else {
		m.addOther(instDecisions, decisionAttrs(d.Policy, d.Outcome, d.Reason))
	}
	if waited {
		var opt metric.MeasurementOption
		if job >= 0 {
			m.mu.Lock()
			opt = m.decisions.option(job)
			m.mu.Unlock()
		} else {
			opt = withSystem(decisionAttrs(d.Policy, d.Outcome, d.Reason)...)
		}
		m.wait.Record(ctx, d.Waited.Seconds(), opt)
	}
	if d.Outcome == OutcomePrimaryNoToken {
		if r := reasonSlot(d.Reason); r >= 0 {
			m.missing.n[r].Add(1)
		} else {
			m.addOther(instMissing, []attribute.KeyValue{attribute.String(attrReason, d.Reason.String())})
		}
	}
	for i := range d.Databases {
		dd := &d.Databases[i]
		k := m.database(dd.Database)
		if dd.Reason == ReasonEpoch {
			if k >= 0 {
				m.dbs[k].crossEpoch.n[incomparableSlot(dd.Incomparable)].Add(1)
			} else {
				m.addOther(instCrossEpoch, crossEpochAttrs(dd.Database, dd.Incomparable))
			}
		}
		if d.Action != ActionRun {
			continue
		}
		if slot := m.routeSlot(k, dd); slot >= 0 {
			m.dbs[k].routes.n[slot].Add(1)
		} else {
			m.addOther(instRoutes, routeAttrs(dd.Database, dd.Replica, dd.Outcome, dd.Reason))
		}
	}
}

// routeSlot is dd's slot in m.dbs[k].routes, or -1.
func (m *metrics) routeSlot(k int, dd *DatabaseDecision) int {
	o, r := outcomeSlot(dd.Outcome), reasonSlot(dd.Reason)
	if k < 0 || o < 0 || r < 0 {
		return -1
	}
	j := 0 // the primary
	if dd.Replica != "" {
		reps := m.dbs[k].replicas
		if dd.replica < 0 || int(dd.replica) >= len(reps) || reps[dd.replica] != dd.Replica {
			return -1
		}
		j = 1 + int(dd.replica)
	}
	return (j*numOutcomes+o)*numReasons + r
}
