package outbox

import (
	"bytes"
	"encoding/json"
	"errors"
	"strconv"
	"strings"

	"github.com/caughtup/caughtup/position"
)

// DebeziumEvent is a Debezium change event for PostgreSQL, with or
// without the {"schema": …, "payload": …} wrapper of the JSON converter's
// schemas.enable.
type DebeziumEvent struct {
	// Op is "c" (create), "u" (update), "d" (delete), "r" (snapshot read),
	// "t" (truncate) or "m" (logical decoding message).
	Op string
	// TsMs is when the connector processed the event.
	TsMs int64
	// Before and After are the row images, untouched.
	Before, After json.RawMessage
	Source        DebeziumSource
}

// DebeziumSource is the envelope's source block. Zero means absent for
// every numeric field: PostgreSQL never uses LSN 0 or transaction ID 0.
type DebeziumSource struct {
	Version   string
	Connector string
	Name      string
	TsMs      int64
	// Snapshot is the normalized snapshot marker: "" or "false" for
	// streamed changes, anything else ("true", "first", "last",
	// "incremental", …) for rows read by a snapshot.
	Snapshot string
	DB       string
	Schema   string
	Table    string
	// TxID is the transaction ID, 32 bits as pgoutput reports it (a value
	// above 2^32-1 is taken as an epoch-qualified xid8).
	TxID uint64
	// LSN is the position of the change record, not of its commit: a
	// replica can have replayed it while the row is still invisible.
	LSN  position.LSN
	Xmin uint64
	// Sequence is the raw ["<last commit lsn>","<lsn>"] text.
	Sequence string
}

// CDCReason says why a CDC freshness check came out as it did.
type CDCReason uint8

const (
	// ReasonNone: the check found the event fresh.
	ReasonNone CDCReason = iota

	// Reasons of CDCUnknown (read the primary): no commit-safe rule.

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
	// ReasonReplicaError: the replica could not be asked.
	ReasonReplicaError

	// Reasons of CDCNotYet (wait, re-check, or read the primary).

	// ReasonReplayBehind: the replica has not replayed source.lsn.
	ReasonReplayBehind
	// ReasonInProgress: the change is replayed but the commit is not.
	ReasonInProgress
	// ReasonFuture: the replica has not seen the transaction ID at all.
	ReasonFuture
)

var reasonNames = [...]string{
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
func (r CDCReason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "unknown"
}

// Sentinels for errors.Is on a *CDCError.
var (
	// ErrMalformedEnvelope: the bytes are not a Debezium JSON envelope.
	ErrMalformedEnvelope = errors.New("malformed Debezium envelope")
	// ErrNoCommitSafeRule: the envelope parsed, but nothing in it can
	// prove a replica shows the change; read the primary.
	ErrNoCommitSafeRule = errors.New("no commit-safe freshness rule for this CDC event")
)

// CDCError reports an envelope that cannot be checked against a replica.
// The event is still processable: on the primary.
type CDCError struct {
	Reason CDCReason
	Detail string
}

// Error says what is wrong and that the event should read the primary.
func (e *CDCError) Error() string {
	s := "caughtup/outbox: "
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
func (e *CDCError) Unwrap() error {
	if e.Reason == ReasonMalformed {
		return ErrMalformedEnvelope
	}
	return ErrNoCommitSafeRule
}

func malformed(detail string) *CDCError { return &CDCError{Reason: ReasonMalformed, Detail: detail} }

// MaxEnvelopeSize bounds what ParseDebezium accepts; Kafka's default
// message limit is 1 MiB, and anything far larger is not an envelope.
const MaxEnvelopeSize = 16 << 20

// ParseDebezium parses a Debezium JSON change event. It never panics;
// anything that is not an object with a source block (or a payload
// holding one) returns a *CDCError with ReasonMalformed. Missing or
// unusable lsn and txId are not parse errors: Validate reports them.
func ParseDebezium(data []byte) (DebeziumEvent, error) {
	var ev DebeziumEvent
	if len(data) > MaxEnvelopeSize {
		return ev, malformed("larger than " + strconv.Itoa(MaxEnvelopeSize) + " bytes")
	}
	top, err := object(data)
	if err != nil {
		return ev, malformed(err.Error())
	}
	body := top
	if p, ok := top["payload"]; ok {
		if isNull(p) {
			return ev, malformed(`"payload" is null (a tombstone has no position)`)
		}
		if body, err = object(p); err != nil {
			return ev, malformed(`"payload": ` + err.Error())
		}
	}
	rawSource, ok := body["source"]
	if !ok || isNull(rawSource) {
		return ev, malformed(`no "source" block`)
	}
	src, err := object(rawSource)
	if err != nil {
		return ev, malformed(`"source": ` + err.Error())
	}
	ev.Op, _ = str(body["op"])
	ev.TsMs, _ = signed(body["ts_ms"])
	ev.Before = body["before"]
	ev.After = body["after"]

	s := &ev.Source
	s.Version, _ = str(src["version"])
	s.Connector, _ = str(src["connector"])
	s.Name, _ = str(src["name"])
	s.TsMs, _ = signed(src["ts_ms"])
	s.DB, _ = str(src["db"])
	s.Schema, _ = str(src["schema"])
	s.Table, _ = str(src["table"])
	s.Sequence, _ = str(src["sequence"])
	s.Xmin, _ = unsigned(src["xmin"])
	s.Snapshot = snapshotMarker(src["snapshot"])
	// Positions are read exactly (json.Number text, never float64, which
	// rounds above 2^53) and a wrongly typed one is an error, not a zero:
	// it is what the freshness rule stands on.
	if raw, ok := src["lsn"]; ok && !isNull(raw) {
		lsn, err := lsnValue(raw)
		if err != nil {
			return ev, malformed(`"source.lsn": ` + err.Error())
		}
		s.LSN = lsn
	}
	if raw, ok := src["txId"]; ok && !isNull(raw) {
		v, err := unsigned(raw)
		if err != nil {
			return ev, malformed(`"source.txId": ` + err.Error())
		}
		s.TxID = v
	}
	return ev, nil
}

// Validate reports why no commit-safe rule applies to the event, or nil
// when CDCChecker can decide it.
func (s DebeziumSource) Validate() error {
	switch {
	case !strings.EqualFold(s.Connector, "postgresql"):
		return &CDCError{Reason: ReasonNotPostgreSQL, Detail: "connector " + strconv.Quote(s.Connector)}
	case s.Snapshot != "" && s.Snapshot != "false":
		return &CDCError{Reason: ReasonSnapshot, Detail: "snapshot " + strconv.Quote(s.Snapshot)}
	case s.LSN == 0:
		return &CDCError{Reason: ReasonMissingLSN}
	case s.TxID == 0:
		return &CDCError{Reason: ReasonMissingTxID}
	}
	return nil
}

// Validate is the source's Validate, plus the snapshot read op "r".
func (e DebeziumEvent) Validate() error {
	if e.Op == "r" {
		return &CDCError{Reason: ReasonSnapshot, Detail: `op "r"`}
	}
	return e.Source.Validate()
}

func object(raw json.RawMessage) (map[string]json.RawMessage, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || raw[0] != '{' {
		return nil, errors.New("not a JSON object")
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, err
	}
	return m, nil
}

func isNull(raw json.RawMessage) bool { return string(bytes.TrimSpace(raw)) == "null" }

func str(raw json.RawMessage) (string, bool) {
	var s string
	if raw == nil || json.Unmarshal(raw, &s) != nil {
		return "", false
	}
	return s, true
}

// numberText returns the digits of a JSON integer, or of a string holding
// one (some converters quote 64-bit numbers).
func numberText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) > 0 && raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", err
		}
		return s, nil
	}
	var n json.Number
	if err := json.Unmarshal(raw, &n); err != nil {
		return "", errors.New("want an integer")
	}
	return n.String(), nil
}

func unsigned(raw json.RawMessage) (uint64, error) {
	if raw == nil {
		return 0, errors.New("absent")
	}
	t, err := numberText(raw)
	if err != nil {
		return 0, err
	}
	v, err := strconv.ParseUint(t, 10, 64)
	if err != nil {
		return 0, errors.New("want a non-negative integer below 2^64, got " + strconv.Quote(truncate(t, 32)))
	}
	return v, nil
}

func signed(raw json.RawMessage) (int64, error) {
	if raw == nil {
		return 0, errors.New("absent")
	}
	t, err := numberText(raw)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(t, 10, 64)
}

// lsnValue accepts Debezium's integer form and the server's "X/Y" text.
func lsnValue(raw json.RawMessage) (position.LSN, error) {
	if s, ok := str(raw); ok && strings.Contains(s, "/") {
		return position.ParseLSN(s)
	}
	v, err := unsigned(raw)
	return position.LSN(v), err
}

// snapshotMarker normalizes Debezium's snapshot field, a boolean in old
// versions and a string enum in new ones.
func snapshotMarker(raw json.RawMessage) string {
	if raw == nil || isNull(raw) {
		return ""
	}
	var b bool
	if json.Unmarshal(raw, &b) == nil {
		return strconv.FormatBool(b)
	}
	if s, ok := str(raw); ok {
		return strings.ToLower(s)
	}
	return "unrecognized"
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
