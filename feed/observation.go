package feed

import (
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/sign"
)

// The observations the feed carries are replay's values (replay owns what
// a feed is; this package is its Redis transport). These names stay so
// that code written against feed reads as before.

// Role says what kind of node an observation is about (replay.FeedRole).
type Role = replay.FeedRole

// The roles, replay's.
const (
	RolePrimary = replay.FeedRolePrimary
	RoleReplica = replay.FeedRoleReplica
)

// Observation is one poll of one node, as a publisher saw it
// (replay.FeedObservation). On the wire its Database, Node and the
// publisher's name are 1–MaxNameLen bytes of UTF-8 without control
// characters (the primary's Node may be empty), and Err at most
// MaxErrLen bytes.
type Observation = replay.FeedObservation

// PrimaryStatus is what one poll of a primary read
// (replay.FeedPrimaryStatus); at most MaxHistory history entries travel.
type PrimaryStatus = replay.FeedPrimaryStatus

// ReplicaStatus is what one poll of a standby read
// (replay.FeedReplicaStatus). Times travel with microsecond precision.
type ReplicaStatus = replay.FeedReplicaStatus

// Wire limits. A message that exceeds them is malformed; Publish refuses
// an observation that would exceed them, except Err, which it cuts, and
// a timeline history, which it drops (sent as unknown).
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
