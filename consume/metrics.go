package consume

import (
	"context"
	"slices"
	"sort"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/replicapool"
)

// ScopeName is the instrumentation scope of every instrument and span this
// package creates.
const ScopeName = "github.com/caughtup/caughtup/consume"

// Attribute names on metrics and log fields, besides db.system.name.
const (
	attrPolicy   = "caughtup.policy"
	attrOutcome  = "caughtup.outcome"
	attrReason   = "caughtup.reason"
	attrDatabase = "caughtup.database"
	attrReplica  = "caughtup.replica"
	attrSource   = "caughtup.source" // logs and spans only: Job.Source
	attrBudget   = "caughtup.budget"
	attrResult   = "caughtup.result"
)

// metrics holds a Router's instruments.
//
// Counts are synchronous instruments: the SDK keeps their sums, so they
// survive Close, and two routers made one after the other on one
// MeterProvider add to the same series instead of reporting it twice.
// Every attribute set is built once per combination (policy × outcome ×
// reason, database × replica × outcome × reason, …) and kept with its
// ready-made option slices, so recording a job does no attribute work.
// Sets are built on first use because Decide produces few of the
// combinations the enums allow.
//
// The tracker's instruments (replica lag, staleness, queries, restarts)
// are replay's.
type metrics struct {
	meter metric.Meter

	decisions  metric.Int64Counter
	routes     metric.Int64Counter
	missing    metric.Int64Counter
	crossEpoch metric.Int64Counter
	future     metric.Int64Counter
	wait       metric.Float64Histogram

	connections    metric.Int64Counter
	connectionSets [replicapool.NumChecks]metric.AddOption
	exclusions     metric.Int64Counter

	decisionSets attrSets // policy × outcome × reason
	missingSets  attrSets // reason
	futureSet    *measurement
	dbs          []dbMetrics // sorted by name, as Snapshot.Databases
}

// dbMetrics holds the attribute sets of one configured database.
type dbMetrics struct {
	name       string
	replicas   []string // Config order
	routes     attrSets // (1 + replica) × outcome × reason; slot 0 is the primary
	crossEpoch attrSets // position.Incomparable
	// node gauges: the primary, then each replica.
	primary *measurement
	nodes   []*measurement
}

// measurement is one attribute set, as the options the instruments take.
type measurement struct {
	add     []metric.AddOption
	rec     []metric.RecordOption
	observe []metric.ObserveOption
}

// withSystem is the attribute set db.system.name plus kv, as the one
// option every kind of instrument takes.
func withSystem(kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(append([]attribute.KeyValue{semconv.DBSystemNamePostgreSQL}, kv...)...))
}

// newMeasurement builds the options for db.system.name plus kv.
func newMeasurement(kv ...attribute.KeyValue) *measurement {
	opt := withSystem(kv...)
	return &measurement{
		add:     []metric.AddOption{opt},
		rec:     []metric.RecordOption{opt},
		observe: []metric.ObserveOption{opt},
	}
}

// attrSets numbers a fixed list of attribute combinations and builds each
// one's measurement once, on first use; concurrent first uses may both
// build it, and one wins.
type attrSets struct {
	sets  []atomic.Pointer[measurement]
	attrs func(slot int) []attribute.KeyValue // without db.system.name
}

func newAttrSets(n int, attrs func(slot int) []attribute.KeyValue) attrSets {
	return attrSets{sets: make([]atomic.Pointer[measurement], n), attrs: attrs}
}

func (s *attrSets) get(slot int) *measurement {
	if m := s.sets[slot].Load(); m != nil {
		return m
	}
	m := newMeasurement(s.attrs(slot)...)
	if s.sets[slot].CompareAndSwap(nil, m) {
		return m
	}
	return s.sets[slot].Load()
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

func reasonAttrs(r Reason) []attribute.KeyValue {
	return []attribute.KeyValue{attribute.String(attrReason, r.String())}
}

// newMetrics creates the instruments for the databases of cfg. The
// gauges report nothing until gauges registers their callback.
func newMetrics(mp metric.MeterProvider, databases map[string]replay.Database) (*metrics, error) {
	meter := mp.Meter(ScopeName)
	m := &metrics{meter: meter}
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
	if m.future, err = meter.Int64Counter("caughtup.consume.tokens.future",
		metric.WithUnit("{token}"),
		metric.WithDescription("Jobs whose token was captured more than Config.ClockSkewTolerance ahead of the consumer's clock (producer clock ahead); their age counts as unknown, so they are not deferred.")); err != nil {
		return nil, err
	}

	if m.connections, err = meter.Int64Counter("caughtup.consume.replica.connections",
		metric.WithUnit("{acquire}"),
		metric.WithDescription("Routed handlers' acquires of replica connections, by caughtup.result: same_server (a direct connection to a server known to have replayed the token, no query), verified (a direct connection to another server that had replayed it, one query), in_transaction (a connection through a pooler, checked in the transaction its reads run in), behind (a server behind the token, or one that could not tell: the connection was given back).")); err != nil {
		return nil, err
	}
	m.connectionSets = newConnectionSets()
	if m.exclusions, err = meter.Int64Counter("caughtup.consume.replica.exclusions",
		metric.WithUnit("{exclusion}"),
		metric.WithDescription("Times this process's handlers could not use a replica (it refused or timed out their connections, or they kept reaching a server behind the job) and the router left it out of its decisions, by caughtup.reason unreachable or behind: once per exclusion, however long failures in a row make it.")); err != nil {
		return nil, err
	}

	m.decisionSets = newAttrSets(numPolicies*numOutcomes*numReasons, func(slot int) []attribute.KeyValue {
		return decisionAttrs(Policy(slot/(numOutcomes*numReasons)), Outcome(slot/numReasons%numOutcomes), Reason(slot%numReasons))
	})
	m.missingSets = newAttrSets(numReasons, func(slot int) []attribute.KeyValue { return reasonAttrs(Reason(slot)) })
	m.futureSet = newMeasurement()
	names := make([]string, 0, len(databases))
	for name := range databases {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		dm := dbMetrics{name: name, primary: newMeasurement(attribute.String(attrDatabase, name))}
		for _, r := range databases[name].Replicas {
			dm.replicas = append(dm.replicas, r.Name)
			dm.nodes = append(dm.nodes, newMeasurement(attribute.String(attrDatabase, name), attribute.String(attrReplica, r.Name)))
		}
		replicas := slices.Clone(dm.replicas)
		dm.routes = newAttrSets((1+len(replicas))*numOutcomes*numReasons, func(slot int) []attribute.KeyValue {
			replica := ""
			if j := slot / (numOutcomes * numReasons); j > 0 {
				replica = replicas[j-1]
			}
			return routeAttrs(name, replica, Outcome(slot/numReasons%numOutcomes), Reason(slot%numReasons))
		})
		dm.crossEpoch = newAttrSets(numIncomparable, func(slot int) []attribute.KeyValue {
			return crossEpochAttrs(name, position.Incomparable(slot))
		})
		m.dbs = append(m.dbs, dm)
	}
	return m, nil
}

// database returns the attribute sets of a configured database, or nil.
func (m *metrics) database(name string) *dbMetrics {
	for i := range m.dbs {
		if m.dbs[i].name == name {
			return &m.dbs[i]
		}
	}
	return nil
}

// decision is the attribute set of a job's decision.
func (m *metrics) decision(d *Decision) *measurement {
	if o, r := outcomeSlot(d.Outcome), reasonSlot(d.Reason); d.Policy.valid() && o >= 0 && r >= 0 {
		return m.decisionSets.get((int(d.Policy)*numOutcomes+o)*numReasons + r)
	}
	// Nothing Decide returns; counted all the same.
	return newMeasurement(decisionAttrs(d.Policy, d.Outcome, d.Reason)...)
}

// route is the attribute set of one database's route.
func (m *metrics) route(dm *dbMetrics, dd *DatabaseDecision) *measurement {
	o, r := outcomeSlot(dd.Outcome), reasonSlot(dd.Reason)
	if dm == nil || o < 0 || r < 0 {
		return newMeasurement(routeAttrs(dd.Database, dd.Replica, dd.Outcome, dd.Reason)...)
	}
	j := 0 // the primary
	if dd.Replica != "" {
		if dd.replica < 0 || int(dd.replica) >= len(dm.replicas) || dm.replicas[dd.replica] != dd.Replica {
			return newMeasurement(routeAttrs(dd.Database, dd.Replica, dd.Outcome, dd.Reason)...)
		}
		j = 1 + int(dd.replica)
	}
	return dm.routes.get((j*numOutcomes+o)*numReasons + r)
}

// record counts one routed job: what Route decided, and how long it
// waited when it did.
func (m *metrics) record(ctx context.Context, d *Decision, waited bool) {
	m.recordTo(ctx, d, waited, nil)
}

// recordTo is record with the counts going to t when it is not nil
// (Tally), to be added in bulk by t.Flush. The wait histogram is recorded
// at once: only jobs that waited have it.
func (m *metrics) recordTo(ctx context.Context, d *Decision, waited bool, t *Tally) {
	m.recordInto(ctx, d, waited, t, nil)
}

// recordInto is recordTo that, with t and into, also notes in into the
// slots of t it counted on (Tally.count).
func (m *metrics) recordInto(ctx context.Context, d *Decision, waited bool, t *Tally, into *shapeCounts) {
	job := m.decision(d)
	m.add(ctx, t, counterDecisions, job, into)
	if waited {
		m.wait.Record(ctx, d.Waited.Seconds(), job.rec...)
	}
	if d.Outcome == OutcomePrimaryNoToken {
		var set *measurement
		if r := reasonSlot(d.Reason); r >= 0 {
			set = m.missingSets.get(r)
		} else {
			set = newMeasurement(reasonAttrs(d.Reason)...)
		}
		m.add(ctx, t, counterMissing, set, into)
	}
	if d.ClockSkew > 0 {
		m.add(ctx, t, counterFuture, m.futureSet, into)
	}
	for i := range d.Databases {
		dd := &d.Databases[i]
		dm := m.database(dd.Database)
		if dd.Reason == ReasonEpoch {
			var set *measurement
			if dm != nil {
				set = dm.crossEpoch.get(incomparableSlot(dd.Incomparable))
			} else {
				set = newMeasurement(crossEpochAttrs(dd.Database, dd.Incomparable)...)
			}
			m.add(ctx, t, counterCrossEpoch, set, into)
		}
		if d.Action == ActionRun {
			m.add(ctx, t, counterRoutes, m.route(dm, dd), into)
		}
	}
}

// add counts one on counter c with set: at once, or in t until t.Flush
// (noting the slot in into, if any).
func (m *metrics) add(ctx context.Context, t *Tally, c counter, set *measurement, into *shapeCounts) {
	if t != nil {
		into.note(t.add(c, set))
		return
	}
	m.counter(c).Add(ctx, 1, set.add...)
}
