package consume

import (
	"context"
	"sync"
	"time"

	"github.com/caughtup/caughtup/position"
)

// CaughtUp reports whether, in snapshot s at time now, every database tok
// names has a replica that has replayed tok's position: exactly the
// replicas Decide would route tok to (a fresh, successful observation of
// a healthy node in recovery, on an epoch that compares with the entry,
// not diverged, not held after a restart). Unknown is never caught up: a
// zero token, a database s does not know or that has no replicas, stale
// or failed observations, an entry from another history. The policy does
// not matter: CaughtUp is about the replicas, not about where a job with
// this token would run.
//
// It is what a job deferred for lag waits for: once it is true, routing
// the job again puts it on a replica. cfg must have its defaults applied
// (Router.Config does); nil means all defaults. CaughtUp is pure: no I/O,
// no clock, no allocation.
func CaughtUp(tok position.Token, s *Snapshot, now time.Time, cfg *Config) bool {
	if tok.IsZero() {
		return false
	}
	if cfg == nil {
		cfg = &defaultConfig
	}
	cutoff := now.Add(-cfg.StalenessBound)
	for _, e := range tok.Entries {
		var dd DatabaseDecision
		decideDatabase(&dd, e, s.Database(e.Database), cutoff, 0)
		if dd.Outcome != OutcomeReplica {
			return false
		}
	}
	return true
}

// CaughtUp reports whether tok is caught up in the router's current
// snapshot at the router's clock (see the function CaughtUp). To wait for
// it without polling, use WaitCaughtUp, or check a Snapshot with the
// function CaughtUp and wait on its Changed channel.
func (r *Router) CaughtUp(tok position.Token) bool {
	return CaughtUp(tok, r.tr.snapshot(), r.cfg.Now(), &r.cfg)
}

// WaitCaughtUp returns nil once a replica has replayed tok for every
// database it names (CaughtUp), or ctx's error when ctx ends first. It
// wakes on the tracker's snapshots, not on a timer, and meanwhile makes
// the tracker poll the replicas tok waits on every WaitPollInterval
// (Watch), as a job waiting inside Route does. A token that cannot catch
// up (zero, naming an unknown database) waits until ctx ends: give ctx
// the deadline after which the caller does something else, such as
// routing the job anyway.
func (r *Router) WaitCaughtUp(ctx context.Context, tok position.Token) error {
	snap := r.tr.snapshot()
	if CaughtUp(tok, snap, r.cfg.Now(), &r.cfg) {
		return nil
	}
	stop := r.Watch(tok)
	defer func() { stop() }()
	watched := time.Now()
	for {
		select {
		case <-snap.changed:
		case <-ctx.Done():
			return ctx.Err()
		}
		snap = r.tr.snapshot()
		if CaughtUp(tok, snap, r.cfg.Now(), &r.cfg) {
			return nil
		}
		// Watch speeds up the replicas that answered when it was called;
		// a long wait looks again now and then, so that a replica that
		// recovers meanwhile is sped up too.
		if time.Since(watched) >= r.cfg.PollInterval {
			next := r.Watch(tok)
			stop()
			stop, watched = next, time.Now()
		}
	}
}

// Watch makes the tracker poll the replicas of the databases tok names
// every WaitPollInterval instead of every PollInterval, until stop is
// called, so that a caller waiting for tok (on Snapshot.Changed) learns
// within a few milliseconds that a replica passed it. It speeds up the
// replicas whose last query succeeded when Watch is called; failing,
// diverged and promoted ones keep the slow pace, so that watching never
// turns into a reconnect storm. The load is shared: however many callers
// watch (and jobs wait in Route), a replica is polled at most once per
// WaitPollInterval per Router. stop is idempotent.
func (r *Router) Watch(tok position.Token) (stop func()) {
	s := r.tr.snapshot()
	var undo []func()
	for i := range s.Databases {
		if _, ok := tok.Entry(s.Databases[i].Name); ok {
			undo = append(undo, r.watchDatabase(s, i))
		}
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			for _, u := range undo {
				u()
			}
		})
	}
}

// watchDatabase speeds up polling of database db's replicas that answered
// their last query in s, until the returned function is called.
func (r *Router) watchDatabase(s *Snapshot, db int) func() {
	ds := &s.Databases[db]
	var idx []int
	for j := range ds.Replicas {
		if ds.Replicas[j].Err == nil {
			idx = append(idx, j)
		}
	}
	return r.tr.watch(db, idx)
}

// CatchUp is when the tracker first saw a token caught up (FirstCaughtUp).
type CatchUp struct {
	// Observed is when the observation that showed a replica past the
	// token was made: its query sent, or its feed message received. The
	// replica may have passed the token after this, while the query ran.
	Observed time.Time
	// Read is when that observation's result had been read: the replica
	// had passed the token by then, and a router could know it. It is
	// after the moment the replica passed the token by at most the time
	// since the previous observation of that replica (WaitPollInterval
	// while someone waits on it) plus the query's duration.
	Read time.Time
}

// FirstCaughtUp finds the first of snaps (oldest first, as a follower of
// Router.Snapshot and Snapshot.Changed records them) in which tok is
// caught up, and returns when the tracker saw it: for each database, the
// observation with the earliest Read among the replicas Decide could
// route tok to; across tok's databases, the latest. It returns false if
// tok is caught up in none of them.
//
// It measures the latency of work that could not run at once: from "the
// tracker saw a replica past the job's token" (Read) to, say, the
// handler's start. That leaves out how long the tracker took to notice
// (bounded as CatchUp.Read says); measured from Observed instead, the
// latency includes the query's duration, and may count time from before
// the replica passed the token. Each snapshot is judged at its own
// newest observation time, so the result does not depend on when the
// follower looked. A follower that falls behind skips snapshots
// (Router.Snapshot returns the newest); the replica's state in the next
// one it sees may come from a later observation if the replica was
// polled again in between (WaitPollInterval later while someone waits on
// it), which makes the catch-up look that much later.
//
// cfg must have its defaults applied; nil means all defaults.
func FirstCaughtUp(tok position.Token, snaps []*Snapshot, cfg *Config) (CatchUp, bool) {
	for _, s := range snaps {
		if at, ok := caughtUpAt(tok, s, newestObservation(s), cfg); ok {
			return at, true
		}
	}
	return CatchUp{}, false
}

// caughtUpAt is CaughtUp with the observation that makes tok caught up in
// s (see FirstCaughtUp).
func caughtUpAt(tok position.Token, s *Snapshot, now time.Time, cfg *Config) (CatchUp, bool) {
	if !CaughtUp(tok, s, now, cfg) {
		return CatchUp{}, false
	}
	if cfg == nil {
		cfg = &defaultConfig
	}
	cutoff := now.Add(-cfg.StalenessBound)
	var at CatchUp
	for _, e := range tok.Entries {
		ds := s.Database(e.Database)
		// Decide picks among the caught-up replicas by Spread; every
		// spread from 0 to len-1 names each of them at least once.
		var first CatchUp
		for spread := range len(ds.Replicas) {
			var dd DatabaseDecision
			decideDatabase(&dd, e, ds, cutoff, uint32(spread))
			r := &ds.Replicas[dd.replica]
			if first.Read.IsZero() || r.replayedBy.Before(first.Read) {
				// ObservedAt is the newest observation's; the one that
				// moved Replayed was made no later than it was read.
				first = CatchUp{Observed: r.ObservedAt, Read: r.replayedBy}
				if first.Observed.After(first.Read) {
					first.Observed = first.Read
				}
			}
		}
		if first.Read.After(at.Read) {
			at = first
		}
	}
	return at, true
}

// newestObservation is the latest ObservedAt in s: the snapshot was
// published right after the observation that made it.
func newestObservation(s *Snapshot) time.Time {
	var t time.Time
	if s == nil {
		return t
	}
	for i := range s.Databases {
		ds := &s.Databases[i]
		if ds.Primary.ObservedAt.After(t) {
			t = ds.Primary.ObservedAt
		}
		for j := range ds.Replicas {
			if o := ds.Replicas[j].ObservedAt; o.After(t) {
				t = o
			}
		}
	}
	return t
}
