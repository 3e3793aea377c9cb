package consume

import (
	"context"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/metric"
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
// …tokens.missing, …tokens.cross_epoch, …tokens.future) until Flush adds
// them to the router's counters in bulk. It is for adapters whose job rate
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
// A Tally also allocates its jobs' handler contexts a few at a time (9
// for jobs of one database), which saves about 40 ns a job. Each
// context still belongs to one job and is never reused; a handler that
// keeps its context after it returns keeps its batch (about 2.7 KB) in
// memory.
type Tally struct {
	r *Router
	// slab is the batch the Tally's next handler contexts come from.
	slab atomic.Pointer[routedSlab]
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
	t := &Tally{r: r}
	for c := range t.slots {
		t.slots[c] = make(map[*measurement]*tallySlot)
	}
	return t
}

// add counts one on counter c with set.
func (t *Tally) add(c counter, set *measurement) {
	for i := range t.recent[c] {
		if s := t.recent[c][i].Load(); s != nil && s.set == set {
			s.n.Add(1)
			return
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
}

// nextRouted hands out the next context of t's current batch, starting a
// new batch when it is used up. Each context goes to one job only, and is
// never reused: handlers may keep theirs.
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
// job.Token once it returns.
func (t *Tally) Route(ctx context.Context, job Job) (context.Context, Decision, error) {
	return t.r.route(ctx, &job, t)
}

// Flush adds what t counted since the last Flush to the router's
// counters. ctx's values (not its cancellation) go to the instruments.
func (t *Tally) Flush(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
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
