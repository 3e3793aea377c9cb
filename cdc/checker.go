package cdc

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/position"
)

// Querier runs one query: *pgxpool.Pool, *pgx.Conn and pgx.Tx satisfy it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// DefaultQueryTimeout is Config.QueryTimeout's default.
const DefaultQueryTimeout = time.Second

// Config configures a Checker. The zero Config is valid: every field's
// zero value means its documented default.
type Config struct {
	// QueryTimeout bounds each check's queries on the replica (at most
	// two round trips). A replica that does not answer in time is unknown
	// (ReasonReplicaError) and the event reads the primary, instead of a
	// consumer hanging on a wedged or unreachable standby for as long as
	// TCP takes to notice. Must not be negative.
	// Default: DefaultQueryTimeout (1s).
	// The checker's queries are trivial, so a second means trouble: the
	// bound the replay tracker puts on its observations.
	QueryTimeout time.Duration
	// MeterProvider records caughtup.cdc.checks and caughtup.cdc.primary.
	// Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

// ErrInvalidConfig is wrapped by every error Config.Validate returns.
var ErrInvalidConfig = errors.New("caughtup/cdc: invalid config")

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.QueryTimeout == 0 {
		c.QueryTimeout = DefaultQueryTimeout
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	return c
}

// Validate reports a Config that NewChecker would reject.
func (c Config) Validate() error {
	if c.QueryTimeout < 0 {
		return fmt.Errorf("%w: QueryTimeout %v is negative: leave it zero for %v or give a positive bound", ErrInvalidConfig, c.QueryTimeout, DefaultQueryTimeout)
	}
	return nil
}

// Checker decides whether a replica shows the change a Debezium event
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
// relating xids, see WidenXID), which is right whenever the event's xid is
// within 2^31 of the standby's horizon, as every live xid is.
//
// Check it on the replica you will read from, before reading: both facts
// only move forward, so what is fresh at the check stays fresh for the
// read. A Checker is safe for concurrent use, holds no connection and no
// state besides its counters: make one per process and call it with
// whichever replica the caller chose.
//
// Limits: a Debezium envelope names no system identifier or timeline, so
// across a failover nothing tells whether the event's transaction is in
// the replica's history; a transaction lost in an asynchronous failover
// could have its xid reused by another that commits on the new timeline.
// Route CDC events to the primary for a while after a failover if that
// matters. Snapshot reads are never checked (ReasonSnapshot).
type Checker struct {
	timeout time.Duration
	metrics *metrics
}

// NewChecker returns a Checker for cfg.
func NewChecker(cfg Config) (*Checker, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	return &Checker{timeout: cfg.QueryTimeout, metrics: m}, nil
}

// The replica's replay position and xid horizon in one round trip; the
// status query is only needed once the change itself is replayed.
const (
	stateQuery  = "SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn()::text, pg_snapshot_xmax(pg_current_snapshot())::text"
	statusQuery = "SELECT pg_xact_status($1::text::xid8)"
)

// CheckEnvelope parses a Debezium JSON envelope and checks it. A malformed
// envelope returns StatusUnknown with ReasonMalformed (and the parse
// error), never a panic; envelopes without a commit-safe rule never reach
// the replica.
func (c *Checker) CheckEnvelope(ctx context.Context, replica Querier, envelope []byte) (Event, Result) {
	ev, err := c.ParseEnvelope(ctx, envelope)
	if err != nil {
		var ee *EnvelopeError
		errors.As(err, &ee) // ParseEnvelope returns nothing else
		return ev, Result{Status: StatusUnknown, Reason: ee.Reason, Err: err}
	}
	return ev, c.Check(ctx, replica, ev.Source)
}

// ParseEnvelope is the first half of CheckEnvelope, for a consumer that
// checks the event later on a replica of its choosing: it parses a
// Debezium JSON envelope and validates it (Event.Validate). An envelope
// the rule cannot apply to (malformed, a snapshot read, no lsn or txId,
// another connector) returns an *EnvelopeError and is counted as a
// StatusUnknown check in caughtup.cdc.checks and caughtup.cdc.primary,
// as CheckEnvelope counts it: read the primary. Otherwise call Check with
// the event's Source on the replica, before reading there.
func (c *Checker) ParseEnvelope(ctx context.Context, envelope []byte) (Event, error) {
	ev, err := ParseDebezium(envelope)
	if err == nil {
		err = ev.Validate()
	}
	if err != nil {
		var ee *EnvelopeError
		errors.As(err, &ee) // ParseDebezium and Validate return nothing else
		c.metrics.record(ctx, Result{Status: StatusUnknown, Reason: ee.Reason, Err: err})
	}
	return ev, err
}

// Check applies the rule to src on replica, a pool (or connection) of the
// standby the caller will read from; it must not be nil unless src fails
// Validate (such sources never reach the replica). It runs at most two
// read-only queries, bounded by Config.QueryTimeout, and changes nothing
// but the checker's counters.
func (c *Checker) Check(ctx context.Context, replica Querier, src Source) Result {
	r := c.check(ctx, replica, src)
	c.metrics.record(ctx, r)
	return r
}

func (c *Checker) check(ctx context.Context, replica Querier, src Source) Result {
	if err := src.Validate(); err != nil {
		return Result{Reason: err.(*EnvelopeError).Reason, Err: err}
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	var (
		inRecovery bool
		replayText *string
		xmaxText   string
	)
	if err := replica.QueryRow(ctx, stateQuery, pgx.QueryExecModeSimpleProtocol).Scan(&inRecovery, &replayText, &xmaxText); err != nil {
		return Result{Reason: ReasonReplicaError, Err: err}
	}
	if !inRecovery {
		return Result{Reason: ReasonNotStandby}
	}
	if replayText == nil {
		return Result{Reason: ReasonReplayUnknown}
	}
	replay, err := position.ParseLSN(*replayText)
	if err != nil {
		return Result{Reason: ReasonReplicaError, Err: err}
	}
	res := Result{ReplayLSN: replay}
	if replay < src.LSN {
		res.Status, res.Reason = StatusNotYet, ReasonReplayBehind
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
	err = replica.QueryRow(ctx, statusQuery, pgx.QueryExecModeSimpleProtocol, strconv.FormatUint(xid, 10)).Scan(&status)
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InvalidParameterValue:
		// "transaction ID … is in the future": the standby has not seen it.
		res.Status, res.Reason = StatusNotYet, ReasonFuture
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
		res.Status = StatusFresh
	case "in progress":
		res.Status, res.Reason = StatusNotYet, ReasonInProgress
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
// epoch and one just before it in ref's previous one. (The rule that takes
// ref's epoch and subtracts one when txid is larger would misplace an xid
// from the next epoch that the standby has not completed yet.) ok is false
// for txid 0 and when the result would precede the first normal xid.
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
