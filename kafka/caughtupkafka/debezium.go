package caughtupkafka

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/cdc"
	"github.com/caughtup/caughtup/consume"
	engine "github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// TokenFormat says how the Consumer reads a message's token
// (ConsumerConfig.TokenFormat).
type TokenFormat uint8

const (
	// TokenHeader reads the token from the message's position.HeaderName
	// headers (TokenOf), where the stamping Writer and the outbox
	// publishers put it. A message without one reads the primary.
	TokenHeader TokenFormat = iota
	// TokenDebezium reads each message as a Debezium change event for
	// PostgreSQL (JSON converter, with or without schemas) and routes it
	// by its source position under package cdc's commit-safe rule:
	//
	//   - The token is source.lsn in DebeziumConfig.Database, on the
	//     epoch of the router's primary when the consumer reads the
	//     message (Debezium names none; see DebeziumConfig), captured at
	//     source.ts_ms (the commit time, by the primary's clock), which
	//     bounds deferral as a producer's capture time does.
	//   - source.lsn is the change record's position, below its commit, so
	//     replay >= source.lsn is necessary, not sufficient: the replica
	//     the router picks must also report the event's transaction
	//     committed (cdc.Checker.Check, two small queries on that replica)
	//     before the handler gets it (consume.Job.Verify). A
	//     replica where it is still in progress counts as behind for this
	//     message, and so does every replica that has not replayed past it:
	//     the message waits, is deferred or reads the primary, by the
	//     Policy, under the router's fallback cap, exactly as a stamped
	//     message whose replicas are behind. A replica that cannot tell
	//     (it does not answer, it is not a standby, the transaction is
	//     unknown or aborted there) sends the message to the primary
	//     (consume.ReasonUnverified).
	//   - What the rule cannot vouch for reads the primary and is counted:
	//     a snapshot read (op "r"; consume.ReasonNoToken) or a tombstone
	//     (an empty value; the same), and an envelope that is malformed,
	//     from another connector or without lsn or txId
	//     (consume.ReasonMalformedToken, with a warning naming the topic);
	//     all but tombstones in caughtup.cdc.primary as well.
	//
	// Metrics are a stamped message's (caughtup.consume.decisions,
	// caughtup.kafka.messages) plus the checker's (caughtup.cdc.checks).
	// Jobs the handler enqueues inherit only the positions of the
	// replicas it read (consume.Job.Verify), never source.lsn.
	TokenDebezium
)

// String is the source's name ("header", "debezium").
func (s TokenFormat) String() string {
	switch s {
	case TokenHeader:
		return "header"
	case TokenDebezium:
		return "debezium"
	}
	return fmt.Sprintf("TokenFormat(%d)", uint8(s))
}

// DebeziumConfig configures TokenFormat TokenDebezium.
//
// The epoch. A Debezium envelope names no system identifier or timeline,
// so a message's token takes the epoch of the router's primary when the
// consumer reads the message (once per delivery; every deferral keeps it),
// and no epoch at all, so the primary, while the router has not observed
// its primary within its StalenessBound. Within one history that is
// exact. Across a failover it is what the router knows: an event first
// read before the router has seen the promotion carries the old
// timeline's epoch and, past the switchpoint, reads the primary (as a
// stamped token would); but an event written on the new primary and read
// within that window (the tracker's poll interval, 100ms by default) is
// compared with the old timeline, and a standby still following the old
// primary after the promotion could then pass both the position and the
// commit-status check (a reused transaction ID) without the event's
// write. Route CDC topics with consume.Always for a while after a
// failover that leaves the old primary running if that matters; a
// stamping relay (outbox.LogicalRelay, cdc.TransactionToken) has exact
// epochs.
type DebeziumConfig struct {
	// Database is the logical database (a key of the Router's
	// consume.Config.Databases) whose tables the connector captures.
	// Default: the Router's only database.
	// Required when the Router has several: an envelope names none.
	Database string
	// Checker applies the commit-safe rule on the replica the router chose.
	// Default: cdc.NewChecker with the consumer's MeterProvider and cdc's defaults.
	// cdc bounds its queries (1s), after which the replica counts as unable
	// to tell and the message reads the primary.
	Checker *cdc.Checker
}

// debeziumToken reads msg's token from its Debezium envelope
// (TokenDebezium): the engine's Adapter.Token. ctx is for the checker's
// counters.
func (c *Consumer) debeziumToken(ctx context.Context, msg *kafka.Message) engine.RecordToken {
	if len(msg.Value) == 0 {
		return engine.RecordToken{} // a tombstone: nothing to route by
	}
	ev, err := c.checker.ParseEnvelope(ctx, msg.Value)
	if err != nil {
		var ee *cdc.EnvelopeError
		if errors.As(err, &ee) && ee.Reason == cdc.ReasonSnapshot {
			return engine.RecordToken{} // a row read by the snapshot: no writer's position
		}
		return engine.RecordToken{Err: err}
	}
	src := ev.Source
	captured := time.Time{}
	switch {
	case src.TsMs > 0:
		captured = time.UnixMilli(src.TsMs)
	case ev.TsMs > 0:
		// When the connector processed it: after the commit, so the age
		// is at most understated by the connector's lag.
		captured = time.UnixMilli(ev.TsMs)
	}
	tok := position.New(c.cfg.Debezium.Database, c.primaryEpoch(), src.LSN, position.SourceCDC, captured)
	checker := c.checker
	return engine.RecordToken{Token: tok, Verify: func(ctx context.Context, dd consume.DatabaseDecision, replica *pgxpool.Pool) consume.Verification {
		res := checker.Check(ctx, replica, src)
		switch res.Status {
		case cdc.StatusFresh:
			return consume.Verification{Verdict: consume.VerifyFresh}
		case cdc.StatusNotYet:
			return consume.Verification{Verdict: consume.VerifyBehind, Replayed: res.ReplayLSN}
		}
		err := fmt.Errorf("caughtup/kafka: the CDC check of transaction %d on replica %s found no commit-safe answer (%s)", src.TxID, dd.Replica, res.Reason)
		if res.Err != nil {
			err = fmt.Errorf("%w: %w", err, res.Err)
		}
		return consume.Verification{Err: err}
	}}
}

// primaryEpoch is the epoch of the router's primary of the Debezium
// database, or zero (unknown: the message reads the primary) when the
// router has not observed it within its StalenessBound.
func (c *Consumer) primaryEpoch() position.Epoch {
	db := c.cfg.Router.Snapshot().Database(c.cfg.Debezium.Database)
	if db == nil || db.Primary.ObservedAt.IsZero() || c.now().Sub(db.Primary.ObservedAt) > c.staleness {
		return position.Epoch{}
	}
	return db.Primary.Epoch
}
