package caughtupasynq

import (
	"container/heap"
	"container/list"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// taskKey names an asynq task.
type taskKey struct{ queue, id string }

// entryState is where a wakeEntry is in its wakeSet.
type entryState uint8

const (
	// watching: waiting for a replica to pass its token; in a group heap
	// or, for tokens naming several databases, in multi.
	watching entryState = iota
	// ready: its token is caught up; the task is to be moved to pending
	// at nextTry (in ready).
	ready
	// inFlight: an attempt to move the task is running; in no index but
	// byKey and order.
	inFlight
)

// wakeEntry is a task the middleware deferred: what it waits for, and
// what asynq must still show for the wake to be this deferral's.
type wakeEntry struct {
	key taskKey
	tok position.Token
	// retried is the task's retry count when it was deferred; a deferral
	// leaves it as it is, so a task showing another count has failed (or
	// was judged without ServerConfig's IsFailure) since.
	retried int
	// expires is when the task's deferral delay and a forwarder pass have
	// surely ended: the entry is of no more use.
	expires time.Time
	// deferral is the span context of the deferral's caughtup.defer span,
	// for the wake span's link; nil when it was not sampled.
	deferral *trace.SpanContext

	state   entryState
	group   *wakeGroup // watching, single database
	index   int        // in group.h
	nextTry time.Time  // ready
	tries   int        // attempts that found the task not movable yet
	elem    *list.Element
}

// groupKey: tokens naming one database compare with a snapshot by their
// LSN alone within one epoch: if a position is caught up, so is every
// lower one of the same epoch (Decide's rule is monotone in the LSN).
type groupKey struct {
	database string
	epoch    position.Epoch
}

// wakeGroup is a min-heap of the watching single-database entries of one
// (database, epoch) by LSN: a scan looks at the lowest until one is not
// caught up, so its cost is the number of groups plus the entries it
// wakes, not the number of entries.
type wakeGroup struct {
	key groupKey
	h   []*wakeEntry
}

func (g *wakeGroup) Len() int { return len(g.h) }
func (g *wakeGroup) Less(i, j int) bool {
	return g.h[i].tok.Entries[0].LSN < g.h[j].tok.Entries[0].LSN
}
func (g *wakeGroup) Swap(i, j int) {
	g.h[i], g.h[j] = g.h[j], g.h[i]
	g.h[i].index, g.h[j].index = i, j
}
func (g *wakeGroup) Push(x any) {
	e := x.(*wakeEntry)
	e.index = len(g.h)
	g.h = append(g.h, e)
}
func (g *wakeGroup) Pop() any {
	e := g.h[len(g.h)-1]
	g.h[len(g.h)-1] = nil
	g.h = g.h[:len(g.h)-1]
	e.index = -1
	return e
}

// wakeSet holds the remembered deferrals of one process, at most capacity
// of them: adding to a full set drops the oldest. It does no I/O and takes
// no lock; the waker serializes it.
type wakeSet struct {
	capacity int
	byKey    map[taskKey]*wakeEntry
	order    *list.List // of *wakeEntry, oldest first
	groups   map[groupKey]*wakeGroup
	multi    map[*wakeEntry]struct{}
	ready    map[*wakeEntry]struct{}
}

func newWakeSet(capacity int) *wakeSet {
	return &wakeSet{
		capacity: capacity,
		byKey:    make(map[taskKey]*wakeEntry),
		order:    list.New(),
		groups:   make(map[groupKey]*wakeGroup),
		multi:    make(map[*wakeEntry]struct{}),
		ready:    make(map[*wakeEntry]struct{}),
	}
}

func (s *wakeSet) len() int { return len(s.byKey) }

// add remembers e (state watching), replacing the entry of the same task
// (a task deferred again, perhaps with a new token) and, when the set is
// full, dropping the oldest. It returns whether an entry was replaced and
// how many were evicted.
func (s *wakeSet) add(e *wakeEntry) (replaced bool, evicted int) {
	if old, ok := s.byKey[e.key]; ok {
		s.remove(old)
		replaced = true
	}
	for s.len() >= s.capacity && s.order.Len() > 0 {
		s.remove(s.order.Front().Value.(*wakeEntry))
		evicted++
	}
	s.byKey[e.key] = e
	e.elem = s.order.PushBack(e)
	s.watch(e)
	return replaced, evicted
}

// watch puts e among the entries waiting for their token.
func (s *wakeSet) watch(e *wakeEntry) {
	e.state = watching
	if len(e.tok.Entries) != 1 {
		s.multi[e] = struct{}{}
		return
	}
	k := groupKey{database: e.tok.Entries[0].Database, epoch: e.tok.Entries[0].Epoch}
	g := s.groups[k]
	if g == nil {
		g = &wakeGroup{key: k}
		s.groups[k] = g
	}
	e.group = g
	heap.Push(g, e)
}

// current reports whether e is still the set's entry for its task.
func (s *wakeSet) current(e *wakeEntry) bool { return s.byKey[e.key] == e }

// remove forgets e wherever it is.
func (s *wakeSet) remove(e *wakeEntry) {
	if !s.current(e) {
		return
	}
	delete(s.byKey, e.key)
	s.order.Remove(e.elem)
	e.elem = nil
	s.unindex(e)
}

// unindex takes e out of the index its state puts it in.
func (s *wakeSet) unindex(e *wakeEntry) {
	switch e.state {
	case watching:
		if g := e.group; g != nil {
			heap.Remove(g, e.index)
			e.group = nil
			if g.Len() == 0 {
				delete(s.groups, g.key)
			}
		} else {
			delete(s.multi, e)
		}
	case ready:
		delete(s.ready, e)
	}
}

// forget removes the entry of a task, if any.
func (s *wakeSet) forget(k taskKey) bool {
	e, ok := s.byKey[k]
	if ok {
		s.remove(e)
	}
	return ok
}

// expire drops the entries whose task the deferral's delay has surely
// brought back by now, oldest first (an entry is only kept longer than
// its own expiry while an older one has not expired: no harm, a wake
// finds such a task already gone or running). It returns how many.
func (s *wakeSet) expire(now time.Time) int {
	n := 0
	for f := s.order.Front(); f != nil; f = s.order.Front() {
		e := f.Value.(*wakeEntry)
		if e.expires.After(now) {
			break
		}
		s.remove(e)
		n++
	}
	return n
}

// scan returns the entries whose task is to be moved now, marked
// inFlight: those whose token snap shows caught up (at routerNow, by the
// router's config) and those ready whose nextTry has come (at now).
func (s *wakeSet) scan(snap *replay.Snapshot, routerNow time.Time, cfg *consume.Config, now time.Time, due []*wakeEntry) []*wakeEntry {
	for k, g := range s.groups {
		for g.Len() > 0 && consume.CaughtUp(g.h[0].tok, snap, routerNow, cfg) {
			e := heap.Pop(g).(*wakeEntry)
			e.group, e.state = nil, inFlight
			due = append(due, e)
		}
		if g.Len() == 0 {
			delete(s.groups, k)
		}
	}
	for e := range s.multi {
		if consume.CaughtUp(e.tok, snap, routerNow, cfg) {
			delete(s.multi, e)
			e.state = inFlight
			due = append(due, e)
		}
	}
	for e := range s.ready {
		if !e.nextTry.After(now) {
			delete(s.ready, e)
			e.state = inFlight
			due = append(due, e)
		}
	}
	return due
}

// retryAfter puts an in-flight entry back as ready, to be tried again at
// now plus a backoff that doubles with each try (wakeRetryMin to
// wakeRetryMax).
func (s *wakeSet) retryAfter(e *wakeEntry, now time.Time) {
	if !s.current(e) {
		return
	}
	d := wakeRetryMin << min(e.tries, 16)
	d = min(d, wakeRetryMax)
	e.tries++
	e.state, e.nextTry = ready, now.Add(d)
	s.ready[e] = struct{}{}
}

// next is when the set needs looking at again without a new snapshot:
// the first expiry or retry. Zero if never.
func (s *wakeSet) next() time.Time {
	var t time.Time
	if f := s.order.Front(); f != nil {
		t = f.Value.(*wakeEntry).expires
	}
	for e := range s.ready {
		if t.IsZero() || e.nextTry.Before(t) {
			t = e.nextTry
		}
	}
	return t
}

// watched returns a token naming the databases that watching entries wait
// on (its LSNs mean nothing), for consume.Router.Watch.
func (s *wakeSet) watched(buf []position.Entry) position.Token {
	buf = buf[:0]
	add := func(db string) {
		for _, e := range buf {
			if e.Database == db {
				return
			}
		}
		buf = append(buf, position.Entry{Database: db})
	}
	for k := range s.groups {
		add(k.database)
	}
	for e := range s.multi {
		for _, en := range e.tok.Entries {
			add(en.Database)
		}
	}
	return position.Token{Entries: buf}
}
