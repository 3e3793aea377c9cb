package consume

import (
	"context"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/replicapool"
)

// counter names the Router's counters that a Tally batches.
type counter uint8

const (
	counterDecisions counter = iota
	counterRoutes
	counterMissing
	counterCrossEpoch
	counterFuture
)

func (m *metrics) counter(c counter) metric.Int64Counter {
	switch c {
	case counterRoutes:
		return m.routes
	case counterMissing:
		return m.missing
	case counterCrossEpoch:
		return m.crossEpoch
	case counterFuture:
		return m.future
	}
	return m.decisions
}

const numCounters = int(counterFuture) + 1

// A Tally routes jobs exactly as its Router does, but keeps the counts of
// their decisions (caughtup.consume.decisions, …database.routes,
// …tokens.missing, …tokens.cross_epoch, …tokens.future) and of the checks
// of the replica connections their handlers acquire
// (…replica.connections) until Flush adds them to the router's counters
// in bulk. It is for adapters whose job rate
// makes a counter Add per job a noticeable share of a job's cost: an
// OpenTelemetry SDK Add costs a few hundred nanoseconds, and a Route
// records two or more, while a Kafka consumer with a trivial handler
// spends well under a microsecond per message of its own. The wait
// histogram is recorded at once, and logs are the Router's.
//
// The adapter must Flush regularly (the Kafka consumer does at every
// offset commit) and when it stops, or the counts are late or lost. A
// Tally is safe for concurrent use, but meant for one worker goroutine
// and the one that flushes it.
//
// A Tally's jobs take the same replica among the caught-up ones (one
// worker, one replica), the Router's Tallies each a replica in turn, so
// that a worker's connections stay with one server while the workers
// share the replicas out (Router.spreadFor).
//
// A Tally also allocates its jobs' handler contexts a few at a time (9
// for jobs of one database), which saves about 40 ns a job; a handler
// that keeps its context after it returns keeps its batch (about 2.7 KB)
// in memory.
//
// And a job may repeat an earlier job's decision. Consecutive messages
// often carry the same token: the events of one transaction, an outbox
// relay's batch stamped with one position, everything produced while the
// replicas were paused by a lag spike. A job with a one-database token
// equal to that of the Tally's last job routed to a replica without
// waiting, with the same policy and parent context, routed against the
// same tracker snapshot while the replica chosen is still fresh in it, is
// given that job's handler context and decision: the decision Route would
// make again, but for the decision time (Decision.TokenAge, and the
// replica when another one of the snapshot went stale meanwhile, which
// changes which one the Tally's turn names; a child token's capture time is the earlier job's,
// which only makes it look older). It is counted and logged as a decision
// of its own. Without it a drain after a lag spike pays a context and its
// garbage per message (BenchmarkDrain). Jobs with a Verify, a token error,
// a trace to join (each gets its route span), or whose earlier job's
// replica connections were refused are always decided afresh.
type Tally struct {
	r *Router
	// src is the routeSource of the jobs routed through the Tally.
	src routeSource
	// conns counts, by result, the checks of the replica connections its
	// jobs' handlers acquired (caughtup.consume.replica.connections).
	conns [replicapool.NumChecks]atomic.Int64
	// home is the Spread of every job routed through the Tally
	// (Router.spreadFor): the Router's Tallies take the replicas in turn.
	home uint32
	// monotonic: the Router's clocks (Config.Now, Config.Tracker.Now) are
	// time.Now, so repeat may read the time as the monotonic clock's
	// distance from the last decision's (repeatNow).
	monotonic bool
	// slab is the batch the Tally's next handler contexts come from.
	slab atomic.Pointer[routedSlab]
	// last is the decision a job with the same token may repeat.
	last atomic.Pointer[tallyLast]
	// counts are the slots count found for the last decision: the next
	// one of its shape counts on them.
	counts atomic.Pointer[shapeCounts]
	// plain is the last parent context found to have no span (untraced).
	plain atomic.Pointer[untracedCtx]
	// recent holds, per counter, the slots counted last: a worker's jobs
	// mostly repeat a few decisions (one replica or another), which then
	// cost a few atomic loads and an add.
	recent [numCounters][tallyRecent]atomic.Pointer[tallySlot]
	mu     sync.Mutex // guards slots and next
	// slots holds, per counter, a slot for every attribute set counted
	// so far; slots are never removed, so Flush sees every count.
	slots [numCounters]map[*measurement]*tallySlot
	next  [numCounters]uint8 // the recent entry to replace next
}

// tallyRecent is how many slots per counter a Tally finds without its
// lock: enough for the routes of one database to several replicas.
const tallyRecent = 4

// tallySlot is the count of one attribute set on one counter since the
// last Flush.
type tallySlot struct {
	set *measurement
	n   atomic.Int64
}

// NewTally returns a Tally of r.
func (r *Router) NewTally() *Tally {
	t := &Tally{r: r, home: r.tallies.Add(1) - 1,
		monotonic: isTimeNow(r.cfg.Now) && isTimeNow(r.cfg.Tracker.Now)}
	t.src = routeSource{r: r, t: t}
	for c := range t.slots {
		t.slots[c] = make(map[*measurement]*tallySlot)
	}
	return t
}

// add counts one on counter c with set, and returns the slot it counted
// on.
func (t *Tally) add(c counter, set *measurement) *tallySlot {
	for i := range t.recent[c] {
		if s := t.recent[c][i].Load(); s != nil && s.set == set {
			s.n.Add(1)
			return s
		}
	}
	t.mu.Lock()
	s := t.slots[c][set]
	if s == nil {
		s = &tallySlot{set: set}
		t.slots[c][set] = s
	}
	t.recent[c][t.next[c]%tallyRecent].Store(s)
	t.next[c]++
	t.mu.Unlock()
	s.n.Add(1)
	return s
}

// shapeCounts are the slots a decision counts on (recordTo's for it),
// found once for every decision of the same shape.
type shapeCounts struct {
	shape countShape
	slots [5]*tallySlot // at most one per counter, for one database
	n     int
	full  bool // more slots than fit: not kept
}

// note adds s to c's slots; c may be nil.
func (c *shapeCounts) note(s *tallySlot) {
	switch {
	case c == nil:
	case c.n < len(c.slots):
		c.slots[c.n] = s
		c.n++
	default:
		c.full = true
	}
}

// countShape is every field of a decision for at most one database that
// recordTo's attribute sets depend on: decisions of one shape count on
// the same slots.
type countShape struct {
	policy          Policy
	action          Action
	outcome         Outcome
	reason          Reason
	skew            bool
	databases       uint8 // 0 or 1
	database        string
	replica         string
	replicaIndex    int32
	databaseOutcome Outcome
	databaseReason  Reason
	incomparable    position.Incomparable
}

// count counts d, a decision made without a wait or one repeat gave
// again, as recordTo would, on the slots found for the last decision of
// its shape: a worker's decisions mostly have one shape (its replica), and
// then cost a few atomic adds rather than looking the attribute sets up
// again (TestTallyCountsByShape).
func (t *Tally) count(d *Decision) {
	if len(d.Databases) > 1 {
		t.r.met.recordTo(context.Background(), d, false, t)
		return
	}
	sh := countShape{policy: d.Policy, action: d.Action, outcome: d.Outcome, reason: d.Reason, skew: d.ClockSkew > 0}
	if len(d.Databases) == 1 {
		dd := &d.Databases[0]
		sh.databases, sh.database, sh.replica, sh.replicaIndex = 1, dd.Database, dd.Replica, dd.replica
		sh.databaseOutcome, sh.databaseReason, sh.incomparable = dd.Outcome, dd.Reason, dd.Incomparable
	}
	if c := t.counts.Load(); c != nil && c.shape == sh {
		for _, s := range c.slots[:c.n] {
			s.n.Add(1)
		}
		return
	}
	c := &shapeCounts{shape: sh}
	// With a Tally and no wait, recordInto uses no context.
	t.r.met.recordInto(context.Background(), d, false, t, c)
	if !c.full {
		t.counts.Store(c)
	}
}

// nextRouted hands out the next context of t's current batch, starting a
// new batch when it is used up. Each context is handed out once, and is
// never recycled: handlers may keep theirs. (A job that repeats another's
// decision gets that job's context, which Route never modifies after it
// returned it.)
func (t *Tally) nextRouted() *routedOne {
	if s := t.slab.Load(); s != nil {
		if i := s.next.Add(1) - 1; i < routedBatch {
			return &s.items[i]
		}
	}
	s := &routedSlab{}
	s.next.Store(1)
	t.slab.Store(s)
	return &s.items[0]
}

// Route is Router.Route, counted in t. Like it, it keeps nothing of
// job.Token once it returns. A job like the last one may get its context
// and decision (Tally).
func (t *Tally) Route(ctx context.Context, job Job) (context.Context, Decision, error) {
	return t.r.route(ctx, &job, t)
}

// tallyLast holds, for one snapshot, the handler context of the latest
// job routed on it whose decision another job may repeat. Every context
// stored in rc was decided on snap, so that the pair, which two atomics
// could tear, never mixes snapshots; a new snapshot gets a new tallyLast.
type tallyLast struct {
	snap *replay.Snapshot
	rc   atomic.Pointer[routed]
}

// remember offers rc, decided on snap for a job whose parent context was
// parent, to the jobs that follow (repeat). Only a decision that repeat
// can check entirely is kept: every database (one) on a replica, chosen
// without a wait, a Verifier or the fallback cap.
func (t *Tally) remember(snap *replay.Snapshot, rc *routed, parent context.Context) {
	d := &rc.d
	if d.Action != ActionRun || d.Outcome != OutcomeReplica || d.Fallback || len(d.Databases) != 1 {
		return
	}
	// repeat compares parent contexts with ==, which panics on values of
	// a type that is not comparable.
	if typ := reflect.TypeOf(parent); typ == nil || !typ.Comparable() {
		return
	}
	l := t.last.Load()
	if l == nil || l.snap != snap {
		l = &tallyLast{snap: snap}
		t.last.Store(l)
	}
	l.rc.Store(rc)
}

// repeat returns the handler context of the last job remembered, if job
// may have its decision: the same token and policy, the same parent
// context, the same snapshot, and the chosen replica still fresh at now
// (Decide's ReplicaState.Usable), which is all that a decision to run on
// a caught-up replica depends on that can change. It was not waited for
// and no replica connection of it was given back or failed
// (replicapool.Attempt).
func (t *Tally) repeat(ctx context.Context, job *Job) (*routed, bool) {
	if job.TokenErr != nil || job.Verify != nil || len(job.Token.Entries) != 1 {
		return nil, false
	}
	l := t.last.Load()
	if l == nil {
		return nil, false
	}
	rc := l.rc.Load()
	if rc == nil || rc.SourceContext.Context != ctx || rc.attempt.Refused() || rc.attempt.Failed() {
		return nil, false
	}
	dd := &rc.d.Databases[0]
	r := t.r
	if dd.Entry != job.Token.Entries[0] || !rc.captured.Equal(job.Token.CapturedAt) || rc.d.Policy != r.cfg.policy(job.Policy) {
		return nil, false
	}
	now := t.repeatNow(rc)
	snap := r.snapshotAt(now)
	if snap != l.snap {
		return nil, false
	}
	db := snap.Database(dd.Database)
	if db == nil || int(dd.replica) >= len(db.Replicas) || !db.Replicas[dd.replica].Usable(now.Add(-r.cfg.Tracker.StalenessBound)) {
		return nil, false
	}
	return rc, true
}

// untracedCtx is a context found to have no span, and how many contexts
// since were not it.
type untracedCtx struct {
	ctx    context.Context
	misses atomic.Int32
}

// untracedRemember is how many other contexts a remembered untraced
// context outlives: a Kafka partition's worker routes every record in one
// context (its Run's), which is then remembered once, while jobs that
// each come with a context of their own replace it only this rarely.
const untracedRemember = 1024

// untraced reports whether ctx has no span (trace.SpanContextFromContext,
// which walks ctx's chain of values: about 25 ns a record in a Kafka
// partition's context). t (nil: none) remembers the last context found
// without one: a context's values never change, so neither does the
// answer.
func (t *Tally) untraced(ctx context.Context) bool {
	if t == nil {
		return !trace.SpanContextFromContext(ctx).IsValid()
	}
	m := t.plain.Load()
	// Comparing ctx with a remembered context of another dynamic type is
	// false, and one of its own type is comparable: remember checked.
	if m != nil && m.ctx == ctx {
		return true
	}
	if trace.SpanContextFromContext(ctx).IsValid() {
		return false
	}
	if m == nil || m.misses.Add(1) >= untracedRemember {
		if typ := reflect.TypeOf(ctx); typ != nil && typ.Comparable() {
			t.plain.Store(&untracedCtx{ctx: ctx})
		}
	}
	return true
}

// repeatNow is the time at which repeat judges the decision rc again:
// the Router's clock, or, when that is time.Now (monotonic), rc's
// decision time plus the monotonic clock's time since, which reads one
// clock where time.Now reads two (about 30 of 60 ns here): the same
// instant on the monotonic clock, which is what comparing it with the
// tracker's observation times (time.Now's, monotonic too) and with the
// overlay's deadlines uses. Only its wall clock reading can differ from
// time.Now's, by a step of the system's clock since rc was decided, and
// nothing repeat compares uses it.
func (t *Tally) repeatNow(rc *routed) time.Time {
	if t.monotonic {
		return rc.now.Add(time.Since(rc.now))
	}
	return t.r.cfg.Now()
}

// isTimeNow reports whether f is time.Now itself.
func isTimeNow(f func() time.Time) bool {
	return f != nil && reflect.ValueOf(f).Pointer() == reflect.ValueOf(time.Now).Pointer()
}

// Flush adds what t counted since the last Flush to the router's
// counters. ctx's values (not its cancellation) go to the instruments.
func (t *Tally) Flush(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	if m := t.r.met; m != nil {
		for c := range t.conns {
			if n := t.conns[c].Swap(0); n != 0 {
				m.connections.Add(ctx, n, m.connectionSets[c])
			}
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for c, slots := range t.slots {
		for set, s := range slots {
			if n := s.n.Swap(0); n != 0 {
				t.r.met.counter(counter(c)).Add(ctx, n, set.add...)
			}
		}
	}
}
