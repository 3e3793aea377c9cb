package replay

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"time"

	"github.com/caughtup/caughtup/position"
)

// What a position feed is to replay: a FeedSource that Trackers subscribe
// to, a FeedSender that Publishers send to, and the values they carry.
// Package feed implements both on Redis (feed.NewSubscriber,
// feed.NewSender); replay knows no transport.

// FeedSource is a position feed as a Tracker reads it (TrackerConfig.Feed).
// feed.Subscriber implements it on Redis.
type FeedSource interface {
	// Subscribe delivers the feed to h until ctx ends, then returns nil:
	// on every (re)subscription the latest stored observation of each
	// publisher and node, then the live ones, each authentic and not
	// superseded (the source checks signatures and replays), one at a
	// time; and every change of its health. It resubscribes by itself,
	// with backoff, while the transport fails. It may be called several
	// times, concurrently: each call is a subscription of its own.
	Subscribe(ctx context.Context, h FeedHandler) error
	// Destination names where the feed's messages travel (a Redis
	// channel), for logs and the messaging.destination.name attribute.
	Destination() string
}

// FeedHandler is what a FeedSource delivers to.
type FeedHandler struct {
	// OnObservation receives every accepted observation. The next one
	// waits until it returns.
	OnObservation func(FeedDelivery)
	// OnHealth receives every change of the subscription's health.
	OnHealth func(FeedHealth)
	// SilenceBound: with no authentic observation for this long the
	// subscription is FeedSilent. Zero means the source's own.
	SilenceBound time.Duration
}

// FeedSender sends a Publisher's observations to a position feed
// (PublisherConfig.Feed). feed.Sender implements it on Redis.
type FeedSender interface {
	// Publish queues o to be sent and returns without waiting for the
	// transport; a newer observation of a node may replace one still
	// waiting. After Close it returns an error wrapping ErrFeedClosed.
	Publish(o FeedObservation) error
	// Flush waits until everything Publish accepted before the call has
	// been sent (or failed).
	Flush(ctx context.Context) error
	// Close sends what is waiting and stops. Idempotent.
	Close() error
	// ID names this sender in the feed.
	ID() PublisherID
	// Destination is as FeedSource's.
	Destination() string
}

// ErrFeedClosed is returned (wrapped) by a FeedSender's Publish after
// Close.
var ErrFeedClosed = errors.New("caughtup/replay: feed sender closed")

// FeedRole says what kind of node a feed observation is about.
type FeedRole uint8

const (
	// FeedRolePrimary: the poll read the primary's epoch, insert
	// position, timeline history and WAL layout.
	FeedRolePrimary FeedRole = 1
	// FeedRoleReplica: the poll read a standby's replay position and the
	// timeline it receives.
	FeedRoleReplica FeedRole = 2
)

// String returns "primary", "replica", or "role(N)" for anything else.
func (r FeedRole) String() string {
	switch r {
	case FeedRolePrimary:
		return "primary"
	case FeedRoleReplica:
		return "replica"
	}
	return "role(" + strconv.Itoa(int(r)) + ")"
}

// FeedObservation is one poll of one node, as a publisher saw it. The
// values are what the node answered, uninterpreted: whether they can be
// true, and what they mean next to other observations, is the tracker's
// merge to decide.
type FeedObservation struct {
	// Database is the logical database name tokens carry.
	Database string
	// Node names the node within its database: the replica's name (as in
	// Replica.Name), or for the primary any label (it may be empty: Role
	// marks it). Required for replicas.
	Node string
	// Role is FeedRolePrimary or FeedRoleReplica.
	Role FeedRole
	// PolledAt is when the poll started, on the publisher's clock. A
	// transport does not send it as a time: it sends how long the
	// publisher held the observation (FeedDelivery.Held), so that no two
	// machines' clocks are compared. Zero: now, when sent.
	PolledAt time.Time
	// Err is the poll's error text; non-empty means the poll failed and
	// the values below are zero.
	Err string
	// Primary holds the values when Role is FeedRolePrimary and Err is
	// empty.
	Primary FeedPrimaryStatus
	// Replica holds the values when Role is FeedRoleReplica and Err is
	// empty.
	Replica FeedReplicaStatus
}

// FeedPrimaryStatus is what one poll of a primary read.
type FeedPrimaryStatus struct {
	// Epoch: system identifier and the timeline of the current WAL file.
	Epoch position.Epoch
	// InsertLSN is pg_current_wal_insert_lsn().
	InsertLSN position.LSN
	// History is the current timeline's history (ancestors with their
	// switchpoints) when HistoryKnown, and empty when it is not.
	History      position.History
	HistoryKnown bool
	// WAL is the server's WAL geometry (pg_control_init()).
	WAL position.WALLayout
}

// FeedReplicaStatus is what one poll of a standby read.
type FeedReplicaStatus struct {
	// InRecovery is pg_is_in_recovery(); false means the node was
	// promoted (or is not a standby at all).
	InRecovery bool
	// Replayed is pg_last_wal_replay_lsn(); 0 stands for NULL.
	Replayed position.LSN
	// Epoch is the system identifier and the WAL receiver's received_tli;
	// a zero part means unknown (no running receiver).
	Epoch position.Epoch
	// ReplayTimestamp is pg_last_xact_replay_timestamp(); zero for NULL.
	ReplayTimestamp time.Time
	// TimeLag is clock_timestamp() − ReplayTimestamp computed on the
	// server (so no client clock enters it); zero when NULL or negative.
	TimeLag time.Duration
	// Incarnation is pg_postmaster_start_time(): a restart of the standby
	// changes it, and with it what its replay position can be compared
	// with. Zero: unknown.
	Incarnation time.Time
	// RecoveryStart is when the standby's startup process (the one that
	// replays WAL) started: it also changes when the postmaster survives a
	// backend crash and reinitializes. Zero: unknown (not in recovery, or
	// the publisher's role lacks pg_read_all_stats).
	RecoveryStart time.Time
}

// SameState reports whether o and p, two observations of one node, say
// the same to a router: the same error, or the same values but for the
// replay timestamp, time lag and poll time, which change with every poll
// of an idle replica and do not decide routing.
func (o *FeedObservation) SameState(p *FeedObservation) bool {
	a, b := o, p
	if a.Role != b.Role || a.Err != b.Err {
		return false
	}
	if a.Err != "" {
		return true
	}
	switch a.Role {
	case FeedRolePrimary:
		x, y := &a.Primary, &b.Primary
		return x.Epoch == y.Epoch && x.InsertLSN == y.InsertLSN && x.WAL == y.WAL &&
			x.HistoryKnown == y.HistoryKnown && slices.Equal(x.History, y.History)
	case FeedRoleReplica:
		x, y := &a.Replica, &b.Replica
		return x.InRecovery == y.InRecovery && x.Replayed == y.Replayed && x.Epoch == y.Epoch &&
			x.Incarnation.Equal(y.Incarnation) && x.RecoveryStart.Equal(y.RecoveryStart)
	}
	return false
}

// PublisherID identifies one publisher process: the configured name and a
// random instance ID drawn when its sender is made.
type PublisherID struct {
	Name     string
	Instance uint64
}

// String prints "name#instance" with the instance in hex.
func (id PublisherID) String() string {
	return id.Name + "#" + strconv.FormatUint(id.Instance, 16)
}

// FeedDelivery is one authentic observation as a FeedSource accepted it.
type FeedDelivery struct {
	// FeedObservation is the node's values. Its PolledAt is the source's
	// estimate of when the poll started, on the receiver's own clock:
	// ReceivedAt − Age.
	FeedObservation
	// Publisher and Seq identify the message: sequence numbers grow per
	// publisher instance.
	Publisher PublisherID
	Seq       uint64
	// KeyID is the key that signed it; empty for an unsigned message an
	// insecure source accepted (or a signature it could not check).
	KeyID string
	// SentAt is the publisher's clock when it sent the message: the
	// tracker uses it only to refuse a message received too long after
	// (FeedConfig.MaxDelay), never to make one look fresher.
	SentAt time.Time
	// ReceivedAt is the receiver's clock when the message was read.
	ReceivedAt time.Time
	// Stored: read from the latest stored values while (re)subscribing,
	// rather than live.
	Stored bool
	// Age is how old the observation was at ReceivedAt, as far as it can
	// be measured without comparing two machines' clocks: the time the
	// publisher held it after the poll started (its monotonic clock),
	// plus, for a stored value, the time it spent stored (measured by the
	// store's clock). A live message's transit is not included.
	Age time.Duration
	// Held is the publisher's part of Age.
	Held time.Duration
}

// FeedState is a feed subscription's health.
type FeedState uint8

const (
	// FeedConnecting: not subscribed yet.
	FeedConnecting FeedState = iota
	// FeedSubscribed: subscribed, the stored values read, and an
	// authentic observation accepted within the silence bound (or the
	// subscription is younger than that). The only state in which the
	// feed may replace local polling.
	FeedSubscribed
	// FeedSilent: subscribed, but no authentic observation for longer
	// than the silence bound: every publisher stopped, or cannot reach
	// the feed.
	FeedSilent
	// FeedUnreachable: the feed cannot be reached or refused to subscribe
	// or to read (FeedHealth.Err says why); the source retries with
	// backoff.
	FeedUnreachable
	// FeedDropped: an established subscription broke; the source
	// resubscribes.
	FeedDropped
	// FeedStopped: the subscription ended (its context did).
	FeedStopped
	numFeedStates
)

var feedStateNames = [numFeedStates]string{"connecting", "subscribed", "silent", "unreachable", "dropped", "stopped"}

// String returns the state's name, e.g. "subscribed".
func (s FeedState) String() string {
	if s < numFeedStates {
		return feedStateNames[s]
	}
	return "state(" + strconv.Itoa(int(s)) + ")"
}

// FeedHealth is a subscription's state and since when, on the receiver's
// clock.
type FeedHealth struct {
	State FeedState
	Since time.Time
	// Err is why, for FeedUnreachable and FeedDropped.
	Err error
}
