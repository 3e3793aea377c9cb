package replay

import (
	"slices"
	"time"

	"github.com/caughtup/caughtup/position"
)

// Snapshot is what the tracker knew at one moment. It is immutable:
// the tracker publishes a new one after every observation, so readers
// take no lock and must not modify what they get.
type Snapshot struct {
	// Seq increases with every published snapshot.
	Seq uint64
	// Databases is sorted by Name.
	Databases []DatabaseState

	// changed is closed when a newer snapshot replaces this one; waiters
	// read a snapshot, decide, and sleep on its channel, so no
	// observation published in between can be missed.
	changed chan struct{}
}

// Changed returns a channel that is closed when the tracker publishes a
// newer snapshot. Check a snapshot, then wait on its Changed: nothing
// published in between can be missed. A Snapshot that no Tracker
// published (one built by hand, for consume.Decide) returns nil, which never fires.
func (s *Snapshot) Changed() <-chan struct{} {
	if s == nil {
		return nil
	}
	return s.changed
}

// WithReplicaErr returns a copy of s in which replica idx of database db
// (indexes of Databases and Replicas) has Err err, so that it counts as
// unknown, sharing s's Changed channel: for a router that knows something
// its tracker does not (its own handlers cannot reach the replica). s is
// not modified; an index out of range returns s.
func (s *Snapshot) WithReplicaErr(db, idx int, err error) *Snapshot {
	if s == nil || db < 0 || db >= len(s.Databases) || idx < 0 || idx >= len(s.Databases[db].Replicas) {
		return s
	}
	out := *s
	out.Databases = slices.Clone(s.Databases)
	ds := &out.Databases[db]
	ds.Replicas = slices.Clone(ds.Replicas)
	ds.Replicas[idx].Err = err
	return &out
}

// WithReplica returns a copy of s in which replica idx of database db
// (indexes of Databases and Replicas) has state st, sharing s's Changed
// channel: for a router that knows better than its tracker which server
// behind a replica pool it would read (consume's balanced endpoints). s is
// not modified; an index out of range returns s.
func (s *Snapshot) WithReplica(db, idx int, st ReplicaState) *Snapshot {
	if s == nil || db < 0 || db >= len(s.Databases) || idx < 0 || idx >= len(s.Databases[db].Replicas) {
		return s
	}
	out := *s
	out.Databases = slices.Clone(s.Databases)
	ds := &out.Databases[db]
	ds.Replicas = slices.Clone(ds.Replicas)
	ds.Replicas[idx] = st
	return &out
}

// Database returns the state of one database, or nil.
func (s *Snapshot) Database(name string) *DatabaseState {
	if s == nil {
		return nil
	}
	for i := range s.Databases {
		if s.Databases[i].Name == name {
			return &s.Databases[i]
		}
	}
	return nil
}

// DatabaseState is what the tracker knows about one database.
type DatabaseState struct {
	Name    string
	Primary PrimaryState
	// Replicas are in the order of the Database's Replicas.
	Replicas []ReplicaState
}

// PrimaryState is the last observation of a primary.
type PrimaryState struct {
	// Epoch is the primary's system identifier and timeline; zero until
	// the first successful observation.
	Epoch position.Epoch
	// History lists the ancestors of Epoch.Timeline with their
	// switchpoints, from the timeline history file. It is valid only when
	// HistoryKnown; on timeline 1 it is empty and known.
	History      position.History
	HistoryKnown bool
	// InsertLSN is pg_current_wal_insert_lsn(), for replica byte lag.
	InsertLSN position.LSN
	// WAL is the server's WAL geometry (pg_control_init()); zero until
	// known. consume.Decide uses it to compare insert positions that point just
	// past a page header (position.WALLayout.InsertEnd).
	WAL position.WALLayout
	// ObservedAt is when the newest successful observation was made (its
	// query sent, or its feed message received).
	ObservedAt time.Time
	// Err is the newest observation's error; nil once a newer observation
	// succeeded.
	Err error

	errAt    time.Time // when the observation behind Err was made
	insertAt time.Time // when the observation behind InsertLSN was made
}

// ReplicaState is the last observation of a replica.
type ReplicaState struct {
	Name string
	// Replayed is pg_last_wal_replay_lsn() with the epoch from
	// pg_control_system() and pg_stat_wal_receiver.received_tli. A zero
	// LSN (NULL) or a zero epoch (receiver not running, or no
	// pg_read_all_stats) makes the replica unusable.
	Replayed position.Replayed
	// InRecovery is pg_is_in_recovery(); false means the node was
	// promoted and is no longer a replica of anything.
	InRecovery bool
	// ReplayTimestamp is pg_last_xact_replay_timestamp(): the primary's
	// commit time of the last replayed transaction; zero if none.
	ReplayTimestamp time.Time
	// TimeLag is the replica's clock minus ReplayTimestamp (server side,
	// so without client clock skew), or 0 while its WAL receiver runs and
	// it has replayed everything received: on an idle primary the age of
	// the last transaction grows while nothing is left to replay.
	TimeLag time.Duration
	// LagBytes is how far Replayed is behind the primary's last observed
	// insert position; meaningful only when LagKnown (same epoch).
	LagBytes uint64
	LagKnown bool
	// Healthy: within TrackerConfig.MaxLagBytes, and not both behind in bytes
	// and over TrackerConfig.MaxLagTime. Unknown lag counts as healthy, since the
	// token comparison alone decides correctness.
	Healthy bool
	// ObservedAt is when the newest successful observation was made (its
	// query sent, or its feed message received): what it returned was
	// true at least from then on.
	ObservedAt time.Time
	// Err is the newest observation's error (ErrImpossibleObservation for
	// one that cannot be true); nil once a newer observation succeeded. A
	// replica with an error is unusable.
	Err error
	// Observations counts successful observations merged.
	Observations uint64

	// Incarnation is the run of the server the state belongs to: its
	// replay only grows within one. A newer one is a restart.
	Incarnation Incarnation
	// Run is Incarnation interned, which the router compares with each
	// handler connection's own run.
	Run RunID
	// Restarts counts the restarts seen (newer incarnations after the
	// first).
	Restarts uint64
	// HighestReplayed is the highest position the replica was ever seen
	// at while it could serve reads (in recovery, epoch known, not
	// diverged), across restarts: no decision's ReadAt exceeds it. A
	// Guard holds new connections below it.
	HighestReplayed position.LSN
	// RestartFloor is set when a restart is seen: the replica counts as
	// behind every token until its replay reaches this (HighestReplayed
	// before the restart), since it may show less than it had replayed
	// (design fact 9). Zero when not held.
	RestartFloor position.LSN
	// Diverged: the replica is on an ancestor of the primary's timeline
	// and has replayed past the point where the primary's history left it
	// (or is on a timeline the primary's history does not contain). It
	// holds WAL the primary does not have and will never follow it, so it
	// is used for no token and waited on by none (ReasonDivergedStandby).
	Diverged bool

	// ReplayedBy is when the observation that set Replayed had certainly
	// been read (its ReadBy): the replica had replayed Replayed by then.
	ReplayedBy time.Time

	errAt time.Time // when the observation behind Err was made
}

// Usable reports whether the replica's state may be trusted: a fresh
// (observed at or after cutoff), successful observation of a healthy node
// in recovery with a known position and epoch. Anything else is
// infinitely behind. Divergence and the restart hold depend on the token
// and the primary, and are the decision's to check. This is the one
// predicate of "unknown is infinitely behind".
func (r *ReplicaState) Usable(cutoff time.Time) bool {
	return r.Err == nil && r.InRecovery && r.Healthy &&
		r.Replayed.LSN != position.InvalidLSN && !r.Replayed.Epoch.IsZero() &&
		!r.ObservedAt.IsZero() && !r.ObservedAt.Before(cutoff)
}

// Held reports whether the replica is behind every token because it
// restarted and has not yet replayed what it had before.
func (r *ReplicaState) Held() bool {
	return r.RestartFloor != 0 && r.Replayed.LSN < r.RestartFloor
}

// Stale reports whether the newest successful observation is older than
// cutoff, or there is none.
func (r *ReplicaState) Stale(cutoff time.Time) bool {
	return r.ObservedAt.IsZero() || r.ObservedAt.Before(cutoff)
}
