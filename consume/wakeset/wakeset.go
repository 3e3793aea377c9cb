// Package wakeset is the memory of an adapter's waker: the jobs one
// process deferred for lag, each with the token it waits for, looked at on
// every tracker snapshot so that a job is made runnable again as soon as a
// replica has replayed its token (consume.CaughtUp), rather than when its
// deferral delay ends. It does no I/O, reads no clock and takes no lock:
// its loop, consume/wake's Waker, serializes it, has the adapter move the
// jobs Scan hands out through its queue (a Redis script, a River update)
// and reports back with Remove or RetryAfter.
//
// A scan costs the number of (database, epoch) groups plus the entries it
// hands out, not the number of entries: single-database tokens sit in a
// min-heap by LSN per group, and a group is looked at only down to its
// first entry that is not caught up (consume.CaughtUp is monotone in the
// LSN within one epoch). Tokens naming several databases are checked one
// by one.
package wakeset

import (
	"container/heap"
	"container/list"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// RetryMin and RetryMax bound the backoff between attempts at an entry
// that was not movable yet (RetryAfter): its job still running, or the
// queue's store unreachable.
const (
	RetryMin = 5 * time.Millisecond
	RetryMax = time.Second
)

// state is where an Entry is in its Set.
type state uint8

const (
	// watching: waiting for a replica to pass its token; in a group heap
	// or, for tokens naming several databases, in multi.
	watching state = iota
	// ready: its token is caught up; the job is to be moved at nextTry
	// (in ready).
	ready
	// inFlight: handed out by Scan, not back yet; in no index but byKey
	// and order.
	inFlight
)

// Entry is one deferral: the job (Key), the token it waits for, when the
// deferral's own delay has surely brought the job back (Expires), what
// the adapter needs to move it (Data) and the deferral's span, which the
// span of the job's wake links to (Deferral: nil when it was not
// sampled). The Set owns the rest.
type Entry[K comparable, D any] struct {
	Key      K
	Token    position.Token
	Expires  time.Time
	Data     D
	Deferral *trace.SpanContext

	state   state
	group   *group[K, D] // watching, single database
	index   int          // in group.h
	nextTry time.Time    // ready
	tries   int          // RetryAfter calls
	elem    *list.Element
}

// Tries is how many times the entry was put back with RetryAfter.
func (e *Entry[K, D]) Tries() int { return e.tries }

// groupKey: tokens naming one database compare with a snapshot by their
// LSN alone within one epoch.
type groupKey struct {
	database string
	epoch    position.Epoch
}

// group is a min-heap by LSN of the watching single-database entries of
// one (database, epoch).
type group[K comparable, D any] struct {
	key groupKey
	h   []*Entry[K, D]
}

func (g *group[K, D]) Len() int { return len(g.h) }
func (g *group[K, D]) Less(i, j int) bool {
	return g.h[i].Token.Entries[0].LSN < g.h[j].Token.Entries[0].LSN
}
func (g *group[K, D]) Swap(i, j int) {
	g.h[i], g.h[j] = g.h[j], g.h[i]
	g.h[i].index, g.h[j].index = i, j
}
func (g *group[K, D]) Push(x any) {
	e := x.(*Entry[K, D])
	e.index = len(g.h)
	g.h = append(g.h, e)
}
func (g *group[K, D]) Pop() any {
	e := g.h[len(g.h)-1]
	g.h[len(g.h)-1] = nil
	g.h = g.h[:len(g.h)-1]
	e.index = -1
	return e
}

// Set holds the remembered deferrals of one process, at most its capacity
// of them: adding to a full set drops the oldest.
type Set[K comparable, D any] struct {
	capacity int
	byKey    map[K]*Entry[K, D]
	order    *list.List // of *Entry, oldest first
	groups   map[groupKey]*group[K, D]
	multi    map[*Entry[K, D]]struct{}
	ready    map[*Entry[K, D]]struct{}
}

// New returns an empty set of at most capacity entries (at least 1).
func New[K comparable, D any](capacity int) *Set[K, D] {
	return &Set[K, D]{
		capacity: max(capacity, 1),
		byKey:    make(map[K]*Entry[K, D]),
		order:    list.New(),
		groups:   make(map[groupKey]*group[K, D]),
		multi:    make(map[*Entry[K, D]]struct{}),
		ready:    make(map[*Entry[K, D]]struct{}),
	}
}

// Len is the number of entries, in flight included.
func (s *Set[K, D]) Len() int { return len(s.byKey) }

// Capacity is the set's bound.
func (s *Set[K, D]) Capacity() int { return s.capacity }

// Add remembers e, watching its token, in place of the entry of the same
// key (a job deferred again, perhaps with a new token) and, when the set
// is full, dropping the oldest entries. It returns whether an entry was
// replaced and how many were evicted.
func (s *Set[K, D]) Add(e *Entry[K, D]) (replaced bool, evicted int) {
	if old, ok := s.byKey[e.Key]; ok {
		s.Remove(old)
		replaced = true
	}
	for s.Len() >= s.capacity && s.order.Len() > 0 {
		s.Remove(s.order.Front().Value.(*Entry[K, D]))
		evicted++
	}
	s.byKey[e.Key] = e
	e.elem = s.order.PushBack(e)
	s.watch(e)
	return replaced, evicted
}

func (s *Set[K, D]) watch(e *Entry[K, D]) {
	e.state = watching
	if len(e.Token.Entries) != 1 {
		s.multi[e] = struct{}{}
		return
	}
	k := groupKey{database: e.Token.Entries[0].Database, epoch: e.Token.Entries[0].Epoch}
	g := s.groups[k]
	if g == nil {
		g = &group[K, D]{key: k}
		s.groups[k] = g
	}
	e.group = g
	heap.Push(g, e)
}

// Current reports whether e is still the set's entry for its key: not
// removed, replaced or evicted since it was added.
func (s *Set[K, D]) Current(e *Entry[K, D]) bool { return s.byKey[e.Key] == e }

// Remove forgets e wherever it is; an entry that is not Current is left
// alone.
func (s *Set[K, D]) Remove(e *Entry[K, D]) {
	if !s.Current(e) {
		return
	}
	delete(s.byKey, e.Key)
	s.order.Remove(e.elem)
	e.elem = nil
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

// Forget removes the entry of key, if any, and reports whether there was
// one.
func (s *Set[K, D]) Forget(key K) bool {
	e, ok := s.byKey[key]
	if ok {
		s.Remove(e)
	}
	return ok
}

// RemoveFunc removes every entry for which drop returns true (in flight
// included: they are no longer Current when they come back) and returns
// how many. It visits every entry: for rare events, such as a client of
// the adapter stopping.
func (s *Set[K, D]) RemoveFunc(drop func(*Entry[K, D]) bool) int {
	n := 0
	for f := s.order.Front(); f != nil; {
		e := f.Value.(*Entry[K, D])
		f = f.Next()
		if drop(e) {
			s.Remove(e)
			n++
		}
	}
	return n
}

// Expire removes the entries whose Expires is not after now, oldest first
// (an entry is kept past its own expiry only while an older one has not
// expired: no harm, a wake then finds its job already back). It returns
// how many.
func (s *Set[K, D]) Expire(now time.Time) int {
	n := 0
	for f := s.order.Front(); f != nil; f = s.order.Front() {
		e := f.Value.(*Entry[K, D])
		if e.Expires.After(now) {
			break
		}
		s.Remove(e)
		n++
	}
	return n
}

// Scan appends to due, and marks in flight, the entries whose job is to
// be moved now: those whose token snap shows caught up at routerNow by
// cfg (consume.CaughtUp; cfg with its defaults applied), and those put
// back with RetryAfter whose time has come at now. Each entry handed out
// must come back through Remove or RetryAfter.
func (s *Set[K, D]) Scan(snap *replay.Snapshot, routerNow time.Time, cfg *consume.Config, now time.Time, due []*Entry[K, D]) []*Entry[K, D] {
	for k, g := range s.groups {
		for g.Len() > 0 && consume.CaughtUp(g.h[0].Token, snap, routerNow, cfg) {
			e := heap.Pop(g).(*Entry[K, D])
			e.group, e.state = nil, inFlight
			due = append(due, e)
		}
		if g.Len() == 0 {
			delete(s.groups, k)
		}
	}
	for e := range s.multi {
		if consume.CaughtUp(e.Token, snap, routerNow, cfg) {
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

// RetryAfter puts an entry Scan handed out back, to be handed out again
// at now plus a backoff that doubles with each try (RetryMin to
// RetryMax). An entry that is no longer Current is left alone.
func (s *Set[K, D]) RetryAfter(e *Entry[K, D], now time.Time) {
	if !s.Current(e) {
		return
	}
	d := min(RetryMin<<min(e.tries, 16), RetryMax)
	e.tries++
	e.state, e.nextTry = ready, now.Add(d)
	s.ready[e] = struct{}{}
}

// Next is when the set needs looking at again without a new snapshot:
// the first expiry or retry. Zero if never.
func (s *Set[K, D]) Next() time.Time {
	var t time.Time
	if f := s.order.Front(); f != nil {
		t = f.Value.(*Entry[K, D]).Expires
	}
	for e := range s.ready {
		if t.IsZero() || e.nextTry.Before(t) {
			t = e.nextTry
		}
	}
	return t
}

// Watched returns a token naming the databases that watching entries
// wait on (its LSNs mean nothing), for consume.Router.Watch; buf is
// reused for its entries.
func (s *Set[K, D]) Watched(buf []position.Entry) position.Token {
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
		for _, en := range e.Token.Entries {
			add(en.Database)
		}
	}
	return position.Token{Entries: buf}
}
