package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/caughtup/caughtup/internal/retry"
	"github.com/caughtup/caughtup/position"
)

// The logical relay lives in several files: this one (the type, its
// lifecycle and one replication session), logical_setup.go (publication
// and slot), logical_drain.go (rows from before the slot),
// logical_decode.go (pgoutput to Event) and logical_stream.go (batching,
// publishing, confirming). Its config is in config.go.

// LogicalRelay publishes outbox rows from the WAL: a pgoutput logical
// replication stream of the table's inserts. Each transaction's events are
// stamped with that transaction's end position (CommitMessage.
// TransactionEndLSN: the end of its commit record, the exact position a
// replica must replay to show the rows; CommitLSN would be the start of
// the commit record and too early), published after its commit message,
// and confirmed to the slot only once the Publisher has acknowledged them.
//
// The slot keeps every unconfirmed transaction, so a relay that dies at any
// point republishes from the last confirmed one: at least once, no loss.
// Only one relay streams a slot at a time; further instances retry until
// it is free, which makes them hot standbys.
//
// # Rows written before the slot existed
//
// A slot streams only transactions that commit after it was created. When
// the relay creates the slot itself it therefore first drains the rows
// already in the table (as the PollingRelay does, with a conservative
// token) and records completion in the publication's comment; until that
// comment is set, every start drains again. Create the slot early (run the
// relay, or Setup, right after Migrate) and the drain finds nothing.
type LogicalRelay struct {
	cfg     LogicalConfig
	table   tableName
	repl    *pgconn.Config  // the replication connection (replication=database)
	regular *pgx.ConnConfig // drain and row deletes, which need parameters
	metrics *relayMetrics
}

// NewLogicalRelay validates cfg and returns a relay; Run starts it. An
// invalid cfg returns an error wrapping ErrInvalidConfig.
func NewLogicalRelay(cfg LogicalConfig) (*LogicalRelay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	t, _ := parseTable(cfg.Table)
	pc, err := pgconn.ParseConfig(cfg.ConnString)
	if err != nil {
		return nil, invalid("LogicalConfig.ConnString: %w", err)
	}
	pc.RuntimeParams["replication"] = "database"
	regular, err := pgx.ParseConfig(cfg.ConnString)
	if err != nil {
		return nil, invalid("LogicalConfig.ConnString: %w", err)
	}
	// The drain and the row deletes speak SQL with parameters, which a
	// replication connection cannot.
	delete(regular.RuntimeParams, "replication")
	if cfg.DialFunc != nil {
		pc.DialFunc = cfg.DialFunc
		regular.DialFunc = cfg.DialFunc
	}
	m, err := newRelayMetrics(cfg.MeterProvider, "logical", cfg.Database)
	if err != nil {
		return nil, err
	}
	return &LogicalRelay{cfg: cfg, table: t, repl: pc, regular: regular, metrics: m}, nil
}

// Run streams until ctx is done, then returns nil. A lost connection, a
// failed publish or a slot held by another instance ends the session; Run
// logs and counts it, waits with exponential backoff and reconnects, and
// the slot replays everything not yet confirmed.
func (r *LogicalRelay) Run(ctx context.Context) error {
	bo := retry.Doubling(r.cfg.MinBackoff, r.cfg.MaxBackoff)
	for {
		began := time.Now()
		progressed, err := r.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if progressed || time.Since(began) > r.cfg.MaxBackoff {
			bo.Reset()
		}
		wait := bo.NextBackOff()
		stage := stageReplication
		var re *RelayError
		if errors.As(err, &re) {
			stage = re.Stage
		}
		r.metrics.failure(ctx, stage, err)
		r.cfg.Logger.WarnContext(ctx, "caughtup/outbox: logical relay session ended; reconnecting",
			"slot", r.cfg.Slot, "error", err, "retry_in", wait)
		if !retry.Sleep(ctx, wait) {
			return nil
		}
	}
}

// Setup creates the publication and the slot if they do not exist, and
// drains rows written before the slot (see LogicalRelay). Run does this on
// every connect; call Setup next to Migrate so that the slot exists before
// the application writes events.
func (r *LogicalRelay) Setup(ctx context.Context) error {
	conn, err := pgconn.ConnectConfig(ctx, r.repl.Copy())
	if err != nil {
		return fmt.Errorf("caughtup/outbox: logical relay connect: %w", err)
	}
	defer closeConn(conn)
	_, err = r.setup(ctx, conn)
	return err
}

// teardownActiveWait bounds how long Teardown waits for the walsender of a
// relay that just stopped to let go of the slot.
const teardownActiveWait = 10 * time.Second

// Teardown drops the slot and the publication, releasing the WAL the slot
// holds. Stop the relay first: an active slot cannot be dropped. The
// server's walsender outlives a relay that just stopped by a moment, so
// Teardown waits up to teardownActiveWait for the slot to become inactive
// (longer means another relay streams it: an error). Events committed
// after Teardown and before a new slot exists are drained, not streamed,
// when a relay starts again.
func (r *LogicalRelay) Teardown(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.regular.Copy())
	if err != nil {
		return fmt.Errorf("caughtup/outbox: logical relay teardown: %w", err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	// Only this database's slot: one of that name elsewhere belongs to
	// another relay.
	const drop = "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()"
	for deadline := time.Now().Add(teardownActiveWait); ; {
		_, err := conn.Exec(ctx, drop, r.cfg.Slot)
		if err == nil {
			break
		}
		if !isCode(err, pgerrcode.ObjectInUse) || time.Now().After(deadline) {
			return fmt.Errorf("caughtup/outbox: drop slot %s: %w", r.cfg.Slot, err)
		}
		if !retry.Sleep(ctx, 20*time.Millisecond) {
			return fmt.Errorf("caughtup/outbox: drop slot %s: %w", r.cfg.Slot, ctx.Err())
		}
	}
	if _, err := conn.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{r.cfg.Publication}.Sanitize()); err != nil {
		return fmt.Errorf("caughtup/outbox: drop publication %s: %w", r.cfg.Publication, err)
	}
	return nil
}

func (r *LogicalRelay) session(ctx context.Context) (progressed bool, err error) {
	conn, err := pgconn.ConnectConfig(ctx, r.repl.Copy())
	if err != nil {
		return false, fmt.Errorf("connect: %w", err)
	}
	s := &stream{r: r, conn: conn, typeMap: pgtype.NewMap(), relations: map[uint32]outboxColumns{}}
	defer func() {
		if s.cleaner != nil {
			_ = s.cleaner.Close(context.WithoutCancel(ctx))
		}
		closeConn(conn)
	}()
	sys, err := pglogrepl.IdentifySystem(ctx, conn)
	if err != nil {
		return false, fmt.Errorf("IDENTIFY_SYSTEM: %w", err)
	}
	sysID, err := strconv.ParseUint(sys.SystemID, 10, 64)
	if err != nil || sys.Timeline <= 0 {
		return false, fmt.Errorf("IDENTIFY_SYSTEM returned system %q timeline %d", sys.SystemID, sys.Timeline)
	}
	s.epoch = position.Epoch{SystemID: sysID, Timeline: uint32(sys.Timeline)}
	if s.confirmed, err = r.setup(ctx, conn); err != nil {
		return false, err
	}
	r.cfg.Logger.Debug("caughtup/outbox: streaming", "slot", r.cfg.Slot, "confirmed", s.confirmed)
	err = pglogrepl.StartReplication(ctx, conn, r.cfg.Slot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names " + quoteLiteral(r.cfg.Publication)},
	})
	if err != nil {
		return false, fmt.Errorf("START_REPLICATION: %w", err)
	}
	err = s.run(ctx)
	return s.published, err
}
