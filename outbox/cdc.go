package outbox

import (
	"context"
	"errors"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/position"
)

// CDCStatus is the outcome of checking a CDC event against a replica.
type CDCStatus uint8

const (
	// CDCUnknown: no commit-safe rule applies, or the replica could not
	// answer; read the primary. CDCResult.Reason says why.
	CDCUnknown CDCStatus = iota
	// CDCNotYet: the replica does not show the change yet; wait and check
	// again, defer, or read the primary.
	CDCNotYet
	// CDCFresh: the replica shows the change's transaction; read there.
	CDCFresh
)

// String is the status as metrics and logs name it (caughtup.cdc.status).
func (s CDCStatus) String() string {
	switch s {
	case CDCFresh:
		return "fresh"
	case CDCNotYet:
		return "not_yet"
	}
	return "unknown"
}

// CDCResult is what CDCChecker found.
type CDCResult struct {
	Status CDCStatus
	Reason CDCReason
	// Err is the parse or replica error behind ReasonMalformed,
	// ReasonReplicaError and the other CDCUnknown reasons (a *CDCError for
	// those found in the envelope itself).
	Err error
	// ReplayLSN is the replica's pg_last_wal_replay_lsn() when it was read.
	ReplayLSN position.LSN
	// XID is the transaction ID widened to 64 bits, when it was computed.
	XID uint64
	// XactStatus is pg_xact_status's answer ("committed", "in progress",
	// "aborted") when it was asked.
	XactStatus string
}

// Querier runs one query: *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// CDCConfig configures a CDCChecker.
type CDCConfig struct {
	// MeterProvider for caughtup.outbox.cdc.checks and
	// caughtup.outbox.cdc.primary. Default: the global one.
	MeterProvider metric.MeterProvider
}

// CDCChecker decides whether a replica shows the change a Debezium event
// describes. Debezium's source.lsn is the position of the change record,
// before its commit, so replay >= lsn is necessary but not sufficient: a
// replica can have replayed the INSERT while its transaction is still
// uncommitted there. The rule, for a hot standby:
//
//	fresh  ⇔  pg_last_wal_replay_lsn() >= source.lsn
//	          ∧ pg_xact_status(xid8(source.txId)) = 'committed'
//
// On a standby pg_xact_status asks the standby's own view: it answers
// 'in progress' while the transaction's xid is among the standby's known
// running transactions, and 'committed' only after the commit record has
// been replayed and the xid removed from that list — the same two facts a
// new snapshot on the standby consults, in the same order (the function
// checks "in progress" before the commit log precisely so that it cannot
// run ahead of snapshot visibility). An xid the standby has not yet seen
// errors with "transaction ID … is in the future": not yet.
//
// Debezium's txId has 32 bits; xid8 adds the epoch. It is widened
// relative to the standby's pg_snapshot_xmax(pg_current_snapshot()) by the
// signed 32-bit distance between the two (PostgreSQL's own rule for
// relating xids), which is right whenever the event's xid is within 2^31
// of the standby's horizon, as every live xid is. The rule that takes the
// horizon's epoch and subtracts one if the xid is larger would misplace
// an xid from the next epoch that the standby has not completed yet.
//
// Check it on the replica you will read from, before reading: both facts
// only move forward, so what is fresh at the check stays fresh for the
// read. CDCChecker is safe for concurrent use.
//
// Limits: a Debezium envelope names no system identifier or timeline, so
// across a failover nothing tells whether the event's transaction is in
// the replica's history; a transaction lost in an asynchronous failover
// could have its xid reused by another that commits on the new timeline.
// Route CDC events to the primary for a while after a failover if that
// matters. Snapshot reads are never checked (ReasonSnapshot).
type CDCChecker struct {
	metrics *cdcMetrics
}

// NewCDCChecker returns a checker.
func NewCDCChecker(cfg CDCConfig) (*CDCChecker, error) {
	m, err := newCDCMetrics(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	return &CDCChecker{metrics: m}, nil
}

// The replica's replay position and xid horizon in one round trip; the
// status query is only needed once the change itself is replayed.
const (
	cdcStateQuery  = "SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text, pg_snapshot_xmax(pg_current_snapshot())::text"
	cdcStatusQuery = "SELECT pg_xact_status($1::text::xid8)"
)

// CheckEnvelope parses a Debezium JSON envelope and checks it. A malformed
// envelope returns CDCUnknown with ReasonMalformed (and the parse error),
// never a panic.
func (c *CDCChecker) CheckEnvelope(ctx context.Context, replica Querier, envelope []byte) (DebeziumEvent, CDCResult) {
	ev, err := ParseDebezium(envelope)
	if err != nil {
		r := CDCResult{Status: CDCUnknown, Reason: ReasonMalformed, Err: err}
		c.metrics.record(ctx, r)
		return ev, r
	}
	if err := ev.Validate(); err != nil {
		r := CDCResult{Status: CDCUnknown, Reason: err.(*CDCError).Reason, Err: err}
		c.metrics.record(ctx, r)
		return ev, r
	}
	return ev, c.Check(ctx, replica, ev.Source)
}

// Check applies the rule to src on replica, a pool (or connection) of the
// standby the caller will read from; it must not be nil. Sources that fail
// Validate never reach it.
func (c *CDCChecker) Check(ctx context.Context, replica Querier, src DebeziumSource) CDCResult {
	r := c.check(ctx, replica, src)
	c.metrics.record(ctx, r)
	return r
}

func (c *CDCChecker) check(ctx context.Context, replica Querier, src DebeziumSource) CDCResult {
	if err := src.Validate(); err != nil {
		return CDCResult{Reason: err.(*CDCError).Reason, Err: err}
	}
	var (
		inRecovery bool
		replayText *string
		xmaxText   string
	)
	if err := replica.QueryRow(ctx, cdcStateQuery, pgx.QueryExecModeSimpleProtocol).Scan(&inRecovery, &replayText, &xmaxText); err != nil {
		return CDCResult{Reason: ReasonReplicaError, Err: err}
	}
	if !inRecovery {
		return CDCResult{Reason: ReasonNotStandby}
	}
	if replayText == nil {
		return CDCResult{Reason: ReasonReplayUnknown}
	}
	replay, err := position.ParseLSN(*replayText)
	if err != nil {
		return CDCResult{Reason: ReasonReplicaError, Err: err}
	}
	res := CDCResult{ReplayLSN: replay}
	if replay < src.LSN {
		res.Status, res.Reason = CDCNotYet, ReasonReplayBehind
		return res
	}
	xmax, err := strconv.ParseUint(xmaxText, 10, 64)
	if err != nil {
		res.Reason, res.Err = ReasonReplicaError, err
		return res
	}
	xid, ok := WidenXID(src.TxID, xmax)
	if !ok {
		res.Reason = ReasonStatusUnknown
		return res
	}
	res.XID = xid
	var status *string
	err = replica.QueryRow(ctx, cdcStatusQuery, pgx.QueryExecModeSimpleProtocol, strconv.FormatUint(xid, 10)).Scan(&status)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "22023":
		// "transaction ID … is in the future": the standby has not seen it.
		res.Status, res.Reason = CDCNotYet, ReasonFuture
		return res
	case err != nil:
		res.Reason, res.Err = ReasonReplicaError, err
		return res
	case status == nil:
		res.Reason = ReasonStatusUnknown
		return res
	}
	res.XactStatus = *status
	switch *status {
	case "committed":
		res.Status = CDCFresh
	case "in progress":
		res.Status, res.Reason = CDCNotYet, ReasonInProgress
	default:
		res.Reason = ReasonAborted
	}
	return res
}

// WidenXID returns the 64-bit xid8 of txid relative to ref, a full xid
// near it (a standby's snapshot xmax). A txid above 2^32-1 is already
// epoch-qualified and returned as is. The 32-bit txid is placed at the
// signed 32-bit distance from ref's low half — PostgreSQL's own rule for
// relating xids — so an xid just past a wraparound lands in ref's next
// epoch and one just before it in ref's previous one. ok is false for
// txid 0 and when the result would precede the first normal xid.
func WidenXID(txid, ref uint64) (xid8 uint64, ok bool) {
	if txid == 0 {
		return 0, false
	}
	if txid > 0xFFFFFFFF {
		return txid, true
	}
	diff := int64(int32(uint32(txid) - uint32(ref)))
	full := int64(ref) + diff
	if ref > 1<<62 || full < 3 {
		return 0, false
	}
	return uint64(full), true
}
