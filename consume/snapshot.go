package consume

import (
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
// published in between can be missed. A Snapshot that no Router
// published (one built for Decide) returns nil, which never fires.
func (s *Snapshot) Changed() <-chan struct{} {
	if s == nil {
		return nil
	}
	return s.changed
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
	// Replicas are in the order of Config.Databases[Name].Replicas.
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
	// known. Decide uses it to compare insert positions that point just
	// past a page header (position.WALLayout.InsertEnd).
	WAL position.WALLayout
	// ObservedAt is when the last successful query was sent.
	ObservedAt time.Time
	// Err is the last query's error; nil after a success.
	Err error
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
	// so without client clock skew). It grows on an idle primary.
	TimeLag time.Duration
	// LagBytes is how far Replayed is behind the primary's last observed
	// insert position; meaningful only when LagKnown (same epoch).
	LagBytes uint64
	LagKnown bool
	// Healthy: within Config.MaxLagBytes, and not both behind in bytes
	// and over Config.MaxLagTime. Unknown lag counts as healthy, since the
	// token comparison alone decides correctness.
	Healthy bool
	// ObservedAt is when the last successful query was sent: what it
	// returned was true at least from then on.
	ObservedAt time.Time
	// Err is the last query's error; nil after a success. A replica
	// with an error is unusable until its next successful observation.
	Err error
	// Observations counts successful observations.
	Observations uint64
}

// usable reports whether the replica's state may be trusted: a fresh
// (observed at or after cutoff), successful observation of a healthy node
// in recovery with a known position and epoch. Anything else is
// infinitely behind.
func (r *ReplicaState) usable(cutoff time.Time) bool {
	return r.Err == nil && r.InRecovery && r.Healthy &&
		r.Replayed.LSN != position.InvalidLSN && !r.Replayed.Epoch.IsZero() &&
		!r.ObservedAt.IsZero() && !r.ObservedAt.Before(cutoff)
}

func (r *ReplicaState) stale(cutoff time.Time) bool {
	return r.ObservedAt.IsZero() || r.ObservedAt.Before(cutoff)
}
