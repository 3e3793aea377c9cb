// Package catchup finds, in a tracker's recorded snapshots, when a token
// was first caught up: what the benchmarks and the chaos and fleet
// programs measure catch-up → handler start from. It is for measuring,
// never for routing.
package catchup

import (
	"time"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// CatchUp is when a tracker first saw a token caught up
// (FirstCaughtUp).
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
// polled again in between, which makes the catch-up look that much later.
//
// cfg must have its defaults applied; nil means all defaults.
func FirstCaughtUp(tok position.Token, snaps []*replay.Snapshot, cfg *consume.Config) (CatchUp, bool) {
	for _, s := range snaps {
		if at, ok := caughtUpAt(tok, s, newestObservation(s), cfg); ok {
			return at, true
		}
	}
	return CatchUp{}, false
}

// caughtUpAt is consume.CaughtUp with the observation that makes tok
// caught up in s (see FirstCaughtUp).
func caughtUpAt(tok position.Token, s *replay.Snapshot, now time.Time, cfg *consume.Config) (CatchUp, bool) {
	if !consume.CaughtUp(tok, s, now, cfg) {
		return CatchUp{}, false
	}
	var at CatchUp
	for _, e := range tok.Entries {
		ds := s.Database(e.Database)
		one := position.Of(tok.CapturedAt, e)
		// Decide picks among the caught-up replicas by Spread; every
		// spread from 0 to len-1 names each of them at least once.
		var first CatchUp
		for spread := range len(ds.Replicas) {
			d := consume.Decide(consume.DecideInput{
				Policy: consume.Sticky, Token: one, Snapshot: s, Now: now, Config: cfg, Spread: uint32(spread),
			})
			dd, ok := d.Database(e.Database)
			if !ok || dd.Replica == "" {
				continue
			}
			r := replicaNamed(ds, dd.Replica)
			if r == nil {
				continue
			}
			if first.Read.IsZero() || r.ReplayedBy.Before(first.Read) {
				// ObservedAt is the newest observation's; the one that
				// moved Replayed was made no later than it was read.
				first = CatchUp{Observed: r.ObservedAt, Read: r.ReplayedBy}
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

func replicaNamed(ds *replay.DatabaseState, name string) *replay.ReplicaState {
	for i := range ds.Replicas {
		if ds.Replicas[i].Name == name {
			return &ds.Replicas[i]
		}
	}
	return nil
}

// newestObservation is the latest ObservedAt in s: the snapshot was
// published right after the observation that made it.
func newestObservation(s *replay.Snapshot) time.Time {
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
