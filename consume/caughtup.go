package consume

import (
	"context"
	"sync"
	"time"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
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
func CaughtUp(tok position.Token, s *replay.Snapshot, now time.Time, cfg *Config) bool {
	if tok.IsZero() {
		return false
	}
	if cfg == nil {
		cfg = &defaultConfig
	}
	cutoff := now.Add(-cfg.Tracker.StalenessBound)
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
	return CaughtUp(tok, r.snapshot(), r.cfg.Now(), &r.cfg)
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
	snap := r.snapshot()
	if CaughtUp(tok, snap, r.cfg.Now(), &r.cfg) {
		return nil
	}
	stop := r.Watch(tok)
	defer func() { stop() }()
	watched := r.cfg.Now()
	for {
		select {
		case <-snap.Changed():
		case <-ctx.Done():
			return ctx.Err()
		}
		snap = r.snapshot()
		if CaughtUp(tok, snap, r.cfg.Now(), &r.cfg) {
			return nil
		}
		// Watch speeds up the replicas that answered when it was called;
		// a long wait looks again now and then, so that a replica that
		// recovers meanwhile is sped up too.
		if r.cfg.Now().Sub(watched) >= r.cfg.Tracker.PollInterval {
			next := r.Watch(tok)
			stop()
			stop, watched = next, r.cfg.Now()
		}
	}
}

// Watch makes the tracker poll the replicas of the databases tok names
// every WaitPollInterval instead of every PollInterval, until stop is
// called, so that a caller waiting for tok (on Snapshot.Changed) learns
// within a few milliseconds that a replica passed it (replay.Tracker.Watch).
// stop is idempotent.
func (r *Router) Watch(tok position.Token) (stop func()) {
	var undo []func()
	for _, e := range tok.Entries {
		undo = append(undo, r.tr.Watch(e.Database))
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
