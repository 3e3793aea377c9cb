package feed

import (
	"slices"
	"strconv"
	"time"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/sign"
)

// Role says what kind of node an observation is about.
type Role uint8

const (
	// RolePrimary: the poll read the primary's epoch, insert position,
	// timeline history and WAL layout.
	RolePrimary Role = 1
	// RoleReplica: the poll read a standby's replay position and the
	// timeline it receives.
	RoleReplica Role = 2
)

// String returns "primary", "replica", or "role(N)" for anything else.
func (r Role) String() string {
	switch r {
	case RolePrimary:
		return "primary"
	case RoleReplica:
		return "replica"
	}
	return "role(" + strconv.Itoa(int(r)) + ")"
}

// Observation is one poll of one node, as a publisher saw it. The values
// are what the node answered, uninterpreted: whether they can be true, and
// what they mean next to other observations, is the subscriber's merge to
// decide (see the package documentation).
type Observation struct {
	// Database is the logical database name tokens carry. 1–128 bytes of
	// UTF-8 without control characters.
	Database string
	// Node names the node within its database: the replica's name (as in
	// replay.Replica.Name), or for the primary any label (it may be
	// empty: Role marks it). At most 128 bytes of UTF-8 without control
	// characters; required for replicas.
	Node string
	// Role is RolePrimary or RoleReplica.
	Role Role
	// PolledAt is when the poll started, on the publisher's clock. It is
	// not sent: the publisher sends how long it held the observation
	// (Delivery.Held), measured on its monotonic clock, so no two
	// machines' clocks are ever compared. Zero: now, at encoding.
	PolledAt time.Time
	// Err is the poll's error text; non-empty means the poll failed and
	// the values below are zero (they are not sent). Publishers cut it to
	// MaxErrLen bytes and replace invalid UTF-8.
	Err string
	// Primary holds the values when Role is RolePrimary and Err is empty.
	Primary PrimaryStatus
	// Replica holds the values when Role is RoleReplica and Err is empty.
	Replica ReplicaStatus
}

// PrimaryStatus is what one poll of a primary read.
type PrimaryStatus struct {
	// Epoch: system identifier and the timeline of the current WAL file.
	Epoch position.Epoch
	// InsertLSN is pg_current_wal_insert_lsn().
	InsertLSN position.LSN
	// History is the current timeline's history (ancestors with their
	// switchpoints) when HistoryKnown; at most MaxHistory entries, and
	// empty when HistoryKnown is false.
	History      position.History
	HistoryKnown bool
	// WAL is the server's WAL geometry (pg_control_init()).
	WAL position.WALLayout
}

// ReplicaStatus is what one poll of a standby read.
type ReplicaStatus struct {
	// InRecovery is pg_is_in_recovery(); false means the node was
	// promoted (or is not a standby at all).
	InRecovery bool
	// Replayed is pg_last_wal_replay_lsn(); 0 stands for NULL.
	Replayed position.LSN
	// Epoch is the system identifier and the WAL receiver's received_tli;
	// a zero part means unknown (no running receiver).
	Epoch position.Epoch
	// ReplayTimestamp is pg_last_xact_replay_timestamp(); zero for NULL.
	// Sent with microsecond precision.
	ReplayTimestamp time.Time
	// TimeLag is clock_timestamp() − ReplayTimestamp computed on the
	// server (so no client clock enters it); zero when NULL or negative.
	// Sent with microsecond precision.
	TimeLag time.Duration
	// Incarnation is pg_postmaster_start_time(): a restart of the standby
	// changes it, and with it what its replay position can be compared
	// with. Zero: unknown. Sent with microsecond precision.
	Incarnation time.Time
	// RecoveryStart is when the standby's startup process (the one that
	// replays WAL) started: it also changes when the postmaster survives a
	// backend crash and reinitializes, which restarts replay from the last
	// restartpoint without changing Incarnation. Zero: unknown (not in
	// recovery, or the publisher's role lacks pg_read_all_stats). Sent,
	// with microsecond precision, only with Incarnation.
	RecoveryStart time.Time
}

// Wire limits. A message that exceeds them is malformed; Publish refuses
// an observation that would exceed them, except Err, which it cuts.
const (
	// MaxMessageSize bounds one encoded message, signature included.
	MaxMessageSize = 16 << 10
	// MaxNameLen bounds Database, Node and the publisher name.
	MaxNameLen = 128
	// MaxKeyIDLen bounds a key ID.
	MaxKeyIDLen = sign.MaxKeyIDLen
	// MaxErrLen bounds Observation.Err on the wire.
	MaxErrLen = 512
	// MaxHistory bounds PrimaryStatus.History (one entry per promotion).
	MaxHistory = 512
)

// SameState reports whether o and p, two observations of one node, say
// the same to a router: the same error, or the same values but for the replay
// timestamp, time lag and poll time, which change with every poll of an
// idle replica and do not decide routing.
func (o *Observation) SameState(p *Observation) bool {
	a, b := o, p
	if a.Role != b.Role || a.Err != b.Err {
		return false
	}
	if a.Err != "" {
		return true
	}
	switch a.Role {
	case RolePrimary:
		x, y := &a.Primary, &b.Primary
		return x.Epoch == y.Epoch && x.InsertLSN == y.InsertLSN && x.WAL == y.WAL &&
			x.HistoryKnown == y.HistoryKnown && slices.Equal(x.History, y.History)
	case RoleReplica:
		x, y := &a.Replica, &b.Replica
		return x.InRecovery == y.InRecovery && x.Replayed == y.Replayed && x.Epoch == y.Epoch &&
			x.Incarnation.Equal(y.Incarnation) && x.RecoveryStart.Equal(y.RecoveryStart)
	}
	return false
}
