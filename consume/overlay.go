package consume

import (
	"time"

	"github.com/caughtup/caughtup/replay"
)

// What this process's handlers find, the tracker may not: a replica its
// handlers cannot use (replicapool.Pool.Excluded) is marked failing in the
// snapshots this router decides on, and a replica whose handler pool knows
// a server behind it that has replayed further than the server the
// tracker watches (a balanced endpoint) shows that server's position
// (replicapool.Pool.Lift). The overlay is derived once per tracker
// snapshot and change of the pools, and cached: a job whose snapshot and
// pools did not change pays a few atomic loads.

// overlay is one derived snapshot: snap, from base with the pools as they
// were at gen, valid until valid (zero: until base or gen changes).
type overlay struct {
	base  *replay.Snapshot
	gen   uint64
	valid time.Time
	snap  *replay.Snapshot
}

// snapshot is the tracker's snapshot as this router decides on it.
func (r *Router) snapshot() *replay.Snapshot { return r.snapshotAt(r.cfg.Now()) }

// snapshotAt is snapshot at now, for a caller that has read the clock
// already: a clock read is a noticeable share of a routed message's cost
// (BenchmarkTallyRoute).
func (r *Router) snapshotAt(now time.Time) *replay.Snapshot {
	base := r.tr.Snapshot()
	if len(r.handlers) == 0 {
		return base
	}
	gen := r.poolGen.Load()
	if o := r.overlaid.Load(); o != nil && o.base == base && o.gen == gen && (o.valid.IsZero() || now.Before(o.valid)) {
		return o.snap
	}
	o := r.overlay(base, gen, now)
	r.overlaid.Store(o)
	return o.snap
}

// overlay derives the snapshot decisions see from base at now.
func (r *Router) overlay(base *replay.Snapshot, gen uint64, now time.Time) *overlay {
	o := &overlay{base: base, gen: gen, snap: base}
	until := func(t time.Time) {
		if !t.IsZero() && (o.valid.IsZero() || t.Before(o.valid)) {
			o.valid = t
		}
	}
	cutoff := now.Add(-r.cfg.Tracker.StalenessBound)
	for db := range base.Databases {
		ds := &base.Databases[db]
		pools := r.handlers[ds.Name]
		for idx := range ds.Replicas {
			if idx >= len(pools) || pools[idx] == nil {
				continue
			}
			p := pools[idx]
			if excluded, err, valid := p.Excluded(now); excluded {
				o.snap = o.snap.WithReplicaErr(db, idx, err)
				until(valid)
				continue
			}
			if st, lifted, valid := p.Lift(ds.Replicas[idx], &ds.Primary, r.cfg.Tracker.MaxLagBytes, now, cutoff); lifted {
				o.snap = o.snap.WithReplica(db, idx, st)
				until(valid)
			}
		}
	}
	return o
}
