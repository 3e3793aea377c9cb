package cdc

import (
	"errors"

	"github.com/caughtup/caughtup/position"
)

// Status is the outcome of checking a CDC event against a replica.
type Status uint8

const (
	// StatusUnknown: no commit-safe rule applies, or the replica could not
	// answer; read the primary. Result.Reason says why. It is the zero
	// value, so a Result nobody filled in never reads a replica.
	StatusUnknown Status = iota
	// StatusNotYet: the replica does not show the change yet; wait and
	// check again, defer, or read the primary.
	StatusNotYet
	// StatusFresh: the replica shows the change's transaction; read there.
	StatusFresh
)

// String is the status as metrics and logs name it (caughtup.cdc.status).
func (s Status) String() string {
	switch s {
	case StatusFresh:
		return "fresh"
	case StatusNotYet:
		return "not_yet"
	}
	return "unknown"
}

// Reason says why a check came out as it did.
type Reason uint8

const (
	// ReasonNone: the check found the event fresh.
	ReasonNone Reason = iota

	// Reasons of StatusUnknown (read the primary): no commit-safe rule.

	// ReasonMalformed: not JSON, or not a Debezium envelope.
	ReasonMalformed
	// ReasonNotPostgreSQL: source.connector is not "postgresql"; LSNs and
	// transaction IDs of other databases mean nothing here.
	ReasonNotPostgreSQL
	// ReasonMissingLSN: no usable source.lsn.
	ReasonMissingLSN
	// ReasonMissingTxID: no usable source.txId, so the commit status
	// cannot be asked.
	ReasonMissingTxID
	// ReasonSnapshot: a row read by a snapshot carries the snapshot's
	// position, not its writer's transaction.
	ReasonSnapshot
	// ReasonNotStandby: the server checked is not in recovery; the rule
	// is only proven for hot standbys.
	ReasonNotStandby
	// ReasonReplayUnknown: pg_last_wal_replay_lsn() is NULL.
	ReasonReplayUnknown
	// ReasonStatusUnknown: pg_xact_status returned NULL (the transaction
	// ID is older than the commit log keeps) or the widened ID is invalid.
	ReasonStatusUnknown
	// ReasonAborted: the replica reports the transaction aborted although
	// it replayed the change; the envelope does not belong to this
	// history (another cluster, a lost timeline).
	ReasonAborted
	// ReasonReplicaError: the replica could not be asked, or did not
	// answer within Config.QueryTimeout.
	ReasonReplicaError

	// Reasons of StatusNotYet (wait, re-check, or read the primary).

	// ReasonReplayBehind: the replica has not replayed source.lsn.
	ReasonReplayBehind
	// ReasonInProgress: the change is replayed but the commit is not.
	ReasonInProgress
	// ReasonFuture: the replica has not seen the transaction ID at all.
	ReasonFuture

	numReasons = iota
)

var reasonNames = [numReasons]string{
	ReasonNone:          "none",
	ReasonMalformed:     "malformed",
	ReasonNotPostgreSQL: "not_postgresql",
	ReasonMissingLSN:    "missing_lsn",
	ReasonMissingTxID:   "missing_txid",
	ReasonSnapshot:      "snapshot",
	ReasonNotStandby:    "not_standby",
	ReasonReplayUnknown: "replay_unknown",
	ReasonStatusUnknown: "status_unknown",
	ReasonAborted:       "aborted",
	ReasonReplicaError:  "replica_error",
	ReasonReplayBehind:  "replay_behind",
	ReasonInProgress:    "in_progress",
	ReasonFuture:        "future_xid",
}

// String is the reason as metrics and logs name it (caughtup.reason).
func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "unknown"
}

// Result is what a Checker found.
type Result struct {
	Status Status
	Reason Reason
	// Err is the parse or replica error behind ReasonMalformed,
	// ReasonReplicaError and the other StatusUnknown reasons (an
	// *EnvelopeError for those found in the envelope itself).
	Err error
	// ReplayLSN is the replica's pg_last_wal_replay_lsn() when it was read.
	ReplayLSN position.LSN
	// XID is the transaction ID widened to 64 bits, when it was computed.
	XID uint64
	// XactStatus is pg_xact_status's answer ("committed", "in progress",
	// "aborted") when it was asked.
	XactStatus string
}

// Sentinels for errors.Is on an *EnvelopeError.
var (
	// ErrMalformedEnvelope: the bytes are not a Debezium JSON envelope.
	ErrMalformedEnvelope = errors.New("malformed Debezium envelope")
	// ErrNoCommitSafeRule: the envelope parsed, but nothing in it can
	// prove a replica shows the change; read the primary.
	ErrNoCommitSafeRule = errors.New("no commit-safe freshness rule for this CDC event")
)

// EnvelopeError reports an envelope that cannot be checked against a
// replica. The event is still processable: on the primary.
type EnvelopeError struct {
	Reason Reason
	Detail string
}

// Error says what is wrong and that the event should read the primary.
func (e *EnvelopeError) Error() string {
	s := "caughtup/cdc: "
	if e.Reason == ReasonMalformed {
		s += ErrMalformedEnvelope.Error()
	} else {
		s += ErrNoCommitSafeRule.Error() + " (" + e.Reason.String() + ")"
	}
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s + "; read the primary"
}

// Unwrap returns ErrMalformedEnvelope or ErrNoCommitSafeRule.
func (e *EnvelopeError) Unwrap() error {
	if e.Reason == ReasonMalformed {
		return ErrMalformedEnvelope
	}
	return ErrNoCommitSafeRule
}

func malformed(detail string) *EnvelopeError {
	return &EnvelopeError{Reason: ReasonMalformed, Detail: detail}
}
