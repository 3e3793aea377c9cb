package cdc

import (
	"bytes"
	"encoding/json"
	"errors"
	"strconv"
	"strings"

	"github.com/caughtup/caughtup/position"
)

// Event is a Debezium change event for PostgreSQL, with or without the
// {"schema": …, "payload": …} wrapper of the JSON converter's
// schemas.enable.
type Event struct {
	// Op is "c" (create), "u" (update), "d" (delete), "r" (snapshot read),
	// "t" (truncate) or "m" (logical decoding message).
	Op string
	// TsMs is when the connector processed the event.
	TsMs int64
	// Before and After are the row images, untouched.
	Before, After json.RawMessage
	Source        Source
}

// Source is the envelope's source block. Zero means absent for every
// numeric field: PostgreSQL never uses LSN 0 or transaction ID 0.
type Source struct {
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
	// replica can have replayed it while the row is still invisible, so
	// it is no token (use Checker, or a relay that stamps
	// TransactionToken).
	LSN  position.LSN
	Xmin uint64
	// Sequence is the raw ["<last commit lsn>","<lsn>"] text.
	Sequence string
}

// MaxEnvelopeSize bounds what ParseDebezium accepts; Kafka's default
// message limit is 1 MiB, and anything far larger is not an envelope.
const MaxEnvelopeSize = 16 << 20

// ParseDebezium parses a Debezium JSON change event. It never panics;
// anything that is not an object with a source block (or a payload
// holding one) returns an *EnvelopeError with ReasonMalformed. Missing or
// unusable lsn and txId are not parse errors: Validate reports them.
func ParseDebezium(data []byte) (Event, error) {
	var ev Event
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
// when Checker can decide it.
func (s Source) Validate() error {
	switch {
	case !strings.EqualFold(s.Connector, "postgresql"):
		return &EnvelopeError{Reason: ReasonNotPostgreSQL, Detail: "connector " + strconv.Quote(s.Connector)}
	case s.Snapshot != "" && s.Snapshot != "false":
		return &EnvelopeError{Reason: ReasonSnapshot, Detail: "snapshot " + strconv.Quote(s.Snapshot)}
	case s.LSN == 0:
		return &EnvelopeError{Reason: ReasonMissingLSN}
	case s.TxID == 0:
		return &EnvelopeError{Reason: ReasonMissingTxID}
	}
	return nil
}

// Validate is the source's Validate, plus the snapshot read op "r".
func (e Event) Validate() error {
	if e.Op == "r" {
		return &EnvelopeError{Reason: ReasonSnapshot, Detail: `op "r"`}
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
