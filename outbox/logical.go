package outbox

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgtype"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/cdc"
	"github.com/caughtup/caughtup/position"
)

// LogicalConfig configures a LogicalRelay. Zero fields take the documented
// defaults.
type LogicalConfig struct {
	// ConnString reaches the primary's database that holds the outbox
	// table, as a URL or keyword/value string; the relay adds
	// replication=database itself. The role needs the REPLICATION
	// attribute and the right to create a publication on the table.
	// Required.
	ConnString string
	// Publisher delivers stamped batches. Required.
	Publisher Publisher
	// Database is the logical database name in the tokens. Default "main".
	Database string
	// Table is the outbox table, "name" or "schema.name". Default
	// DefaultTable.
	Table string
	// Publication is the publication the relay creates (FOR TABLE Table,
	// inserts only) and streams. 1 to 63 of [a-z0-9_]. Default
	// "caughtup_" + the table name.
	Publication string
	// Slot is the logical replication slot (pgoutput). It keeps every
	// transaction the relay has not confirmed, which is what makes restarts
	// lossless, and also keeps the WAL behind it: monitor
	// pg_replication_slots when the relay is down for long. 1 to 63 of
	// [a-z0-9_]. Default "caughtup_" + the table name.
	Slot string
	// MaxBatch is how many events are collected before a publish.
	// Transactions are never split, so a batch can exceed it. Default 500.
	MaxBatch int
	// FlushDelay is how long the first committed transaction waits for
	// others to join its batch. Default 5ms: under load batches fill to
	// MaxBatch long before; when idle it adds 5ms of latency.
	FlushDelay time.Duration
	// StatusInterval is how often the relay reports its confirmed position
	// even without progress; it must stay well below the server's
	// wal_sender_timeout (60s). Default 10s. The relay cannot answer the
	// server while Publisher.Publish runs, so a publish that takes longer
	// than wal_sender_timeout ends the session; it is retried.
	StatusInterval time.Duration
	// KeepRows keeps relayed rows in the table. Default false: the relay
	// deletes them after confirming, on a second, ordinary connection.
	// Deleting is safe at any time because the stream carries the inserted
	// values; the rows matter only to the one-time drain described on
	// LogicalRelay.
	KeepRows bool
	// MinBackoff and MaxBackoff bound the exponential pause before a
	// reconnect. Defaults 100ms and 5s.
	MinBackoff, MaxBackoff time.Duration
	// Logger receives reconnects and their reasons. Default
	// slog.Default().
	Logger *slog.Logger
	// MeterProvider for the relay's instruments. Default: the global one.
	MeterProvider metric.MeterProvider
}

// WithDefaults returns c with every zero field set to its default.
func (c LogicalConfig) WithDefaults() LogicalConfig {
	if c.Database == "" {
		c.Database = DefaultDatabase
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if t, err := parseTable(c.Table); err == nil {
		def := defaultObjectName(t.name)
		if c.Publication == "" {
			c.Publication = def
		}
		if c.Slot == "" {
			c.Slot = def
		}
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = 500
	}
	if c.FlushDelay <= 0 {
		c.FlushDelay = 5 * time.Millisecond
	}
	if c.StatusInterval <= 0 {
		c.StatusInterval = 10 * time.Second
	}
	if c.MinBackoff <= 0 {
		c.MinBackoff = 100 * time.Millisecond
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = 5 * time.Second
	}
	if c.MaxBackoff < c.MinBackoff {
		c.MaxBackoff = c.MinBackoff
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// defaultObjectName turns a table name into a slot-safe name.
func defaultObjectName(table string) string {
	var b strings.Builder
	b.WriteString("caughtup_")
	for _, c := range strings.ToLower(table) {
		if 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '_' {
			b.WriteRune(c)
		} else {
			b.WriteByte('_')
		}
	}
	s := b.String()
	if len(s) > 63 {
		h := fnv.New32a()
		h.Write([]byte(table))
		s = fmt.Sprintf("%s_%08x", s[:54], h.Sum32())
	}
	return s
}

func validObjectName(s string) bool {
	if len(s) == 0 || len(s) > 63 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

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
	repl    *pgconn.Config
	regular *pgx.ConnConfig
	metrics *relayMetrics

	hooks relayHooks
}

// drainedMarker is the publication comment that says the rows written
// before the slot were drained.
const drainedMarker = "caughtup outbox relay: rows written before the slot was created have been relayed"

// NewLogicalRelay validates cfg and returns a relay; Run starts it.
func NewLogicalRelay(cfg LogicalConfig) (*LogicalRelay, error) {
	cfg = cfg.WithDefaults()
	if cfg.Publisher == nil {
		return nil, errors.New("caughtup/outbox: LogicalConfig.Publisher is required")
	}
	if !position.ValidDatabaseName(cfg.Database) {
		return nil, fmt.Errorf("caughtup/outbox: LogicalConfig.Database %q must be 1 to %d of [A-Za-z0-9_-]", cfg.Database, position.MaxDatabaseNameLen)
	}
	t, err := parseTable(cfg.Table)
	if err != nil {
		return nil, err
	}
	if !validObjectName(cfg.Slot) {
		return nil, fmt.Errorf("caughtup/outbox: LogicalConfig.Slot %q must be 1 to 63 of [a-z0-9_]", cfg.Slot)
	}
	if !validObjectName(cfg.Publication) {
		return nil, fmt.Errorf("caughtup/outbox: LogicalConfig.Publication %q must be 1 to 63 of [a-z0-9_]", cfg.Publication)
	}
	if cfg.ConnString == "" {
		return nil, errors.New("caughtup/outbox: LogicalConfig.ConnString is required")
	}
	pc, err := pgconn.ParseConfig(cfg.ConnString)
	if err != nil {
		return nil, fmt.Errorf("caughtup/outbox: LogicalConfig.ConnString: %w", err)
	}
	pc.RuntimeParams["replication"] = "database"
	regular, err := pgx.ParseConfig(cfg.ConnString)
	if err != nil {
		return nil, fmt.Errorf("caughtup/outbox: LogicalConfig.ConnString: %w", err)
	}
	// The drain and the row deletes speak SQL with parameters, which a
	// replication connection cannot.
	delete(regular.RuntimeParams, "replication")
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
	bo := newBackoff(r.cfg.MinBackoff, r.cfg.MaxBackoff)
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
		stage := "replication"
		var re *RelayError
		if errors.As(err, &re) {
			stage = re.Stage
		}
		r.metrics.failed(ctx, stage, err)
		r.cfg.Logger.WarnContext(ctx, "caughtup/outbox: logical relay session ended; reconnecting",
			"slot", r.cfg.Slot, "error", err, "retry_in", wait)
		if !sleepCtx(ctx, wait) {
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

// Teardown drops the slot and the publication, releasing the WAL the slot
// holds. Stop the relay first: an active slot cannot be dropped. Events
// committed after Teardown and before a new slot exists are drained, not
// streamed, when a relay starts again.
func (r *LogicalRelay) Teardown(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.regular.Copy())
	if err != nil {
		return fmt.Errorf("caughtup/outbox: logical relay teardown: %w", err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1", r.cfg.Slot); err != nil {
		return fmt.Errorf("caughtup/outbox: drop slot %s: %w", r.cfg.Slot, err)
	}
	if _, err := conn.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{r.cfg.Publication}.Sanitize()); err != nil {
		return fmt.Errorf("caughtup/outbox: drop publication %s: %w", r.cfg.Publication, err)
	}
	return nil
}

func closeConn(conn *pgconn.PgConn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// simpleQuery runs sql in the simple protocol, the only one a replication
// connection speaks, and returns the text of the first result's rows.
func simpleQuery(ctx context.Context, conn *pgconn.PgConn, sql string) ([][][]byte, error) {
	results, err := conn.Exec(ctx, sql).ReadAll()
	if err != nil {
		return nil, err
	}
	if len(results) == 0 {
		return nil, nil
	}
	return results[0].Rows, results[0].Err
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

func isCode(err error, code string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == code
}

// setup makes sure the publication and the slot exist and that rows from
// before the slot have been drained; it returns the slot's confirmed
// position.
func (r *LogicalRelay) setup(ctx context.Context, conn *pgconn.PgConn) (pglogrepl.LSN, error) {
	pub := quoteLiteral(r.cfg.Publication)
	rows, err := simpleQuery(ctx, conn, "SELECT 1 FROM pg_publication WHERE pubname = "+pub)
	if err != nil {
		return 0, fmt.Errorf("caughtup/outbox: look up publication: %w", err)
	}
	if len(rows) == 0 {
		// The publication must exist before the slot: pgoutput reads it
		// with the catalog as of each decoded transaction.
		_, err := simpleQuery(ctx, conn, "CREATE PUBLICATION "+pgx.Identifier{r.cfg.Publication}.Sanitize()+
			" FOR TABLE "+r.table.ident()+" WITH (publish = 'insert')")
		if err != nil && !isCode(err, "42710") {
			return 0, fmt.Errorf("caughtup/outbox: create publication %s: %w", r.cfg.Publication, err)
		}
	}
	slotRows, err := simpleQuery(ctx, conn, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = "+quoteLiteral(r.cfg.Slot))
	if err != nil {
		return 0, fmt.Errorf("caughtup/outbox: look up slot: %w", err)
	}
	if len(slotRows) == 0 {
		// A new slot needs a new drain: clear the marker first, so that a
		// crash between creating the slot and finishing the drain leaves
		// it unset and the next start drains again.
		if _, err := simpleQuery(ctx, conn, "COMMENT ON PUBLICATION "+pgx.Identifier{r.cfg.Publication}.Sanitize()+" IS NULL"); err != nil {
			return 0, fmt.Errorf("caughtup/outbox: reset drain marker: %w", err)
		}
		_, err := pglogrepl.CreateReplicationSlot(ctx, conn, r.cfg.Slot, "pgoutput",
			pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: "NOEXPORT_SNAPSHOT"})
		if err != nil && !isCode(err, "42710") {
			return 0, fmt.Errorf("caughtup/outbox: create slot %s: %w", r.cfg.Slot, err)
		}
		r.cfg.Logger.InfoContext(ctx, "caughtup/outbox: created logical replication slot", "slot", r.cfg.Slot, "publication", r.cfg.Publication)
		slotRows, err = simpleQuery(ctx, conn, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = "+quoteLiteral(r.cfg.Slot))
		if err != nil {
			return 0, fmt.Errorf("caughtup/outbox: look up slot: %w", err)
		}
	}
	var confirmed pglogrepl.LSN
	if len(slotRows) == 1 && len(slotRows[0]) == 1 && slotRows[0][0] != nil {
		confirmed, _ = pglogrepl.ParseLSN(string(slotRows[0][0]))
	}
	marker, err := simpleQuery(ctx, conn, "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = "+pub)
	if err != nil {
		return 0, fmt.Errorf("caughtup/outbox: read drain marker: %w", err)
	}
	if len(marker) == 1 && marker[0][0] != nil && string(marker[0][0]) == drainedMarker {
		return confirmed, nil
	}
	if err := r.drain(ctx); err != nil {
		return 0, err
	}
	return confirmed, nil
}

// drain relays the rows that were in the table before the slot existed.
// It runs after the slot was created, so every row it misses commits
// after the slot's start and is streamed; rows it sees may be streamed as
// well (duplicates, never loss). A session advisory lock makes concurrent
// starting instances drain one after the other, so none sets the marker
// while another still holds an unpublished batch.
func (r *LogicalRelay) drain(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.regular.Copy())
	if err != nil {
		return fmt.Errorf("caughtup/outbox: drain connect: %w", err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	h := fnv.New64a()
	h.Write([]byte("caughtup/outbox/drain:" + r.cfg.Slot))
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(h.Sum64())); err != nil {
		return fmt.Errorf("caughtup/outbox: drain lock: %w", err)
	}
	var marker *string
	if err := conn.QueryRow(ctx, "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1", r.cfg.Publication).Scan(&marker); err != nil {
		return fmt.Errorf("caughtup/outbox: read drain marker: %w", err)
	}
	if marker != nil && *marker == drainedMarker {
		return nil
	}
	pr, err := NewPollingRelay(PollingConfig{
		DB: conn, Publisher: r.cfg.Publisher, Database: r.cfg.Database, Table: r.cfg.Table,
		KeepPublished: r.cfg.KeepRows, BatchSize: r.cfg.MaxBatch, Logger: r.cfg.Logger, MeterProvider: r.cfg.MeterProvider,
	})
	if err != nil {
		return err
	}
	pr.metrics = r.metrics
	pr.hooks = r.hooks
	total := 0
	for {
		n, err := pr.RelayOnce(ctx)
		if err != nil {
			return fmt.Errorf("caughtup/outbox: drain: %w", err)
		}
		total += n
		if n == 0 {
			break
		}
	}
	if _, err := conn.Exec(ctx, "COMMENT ON PUBLICATION "+pgx.Identifier{r.cfg.Publication}.Sanitize()+" IS "+quoteLiteral(drainedMarker)); err != nil {
		return fmt.Errorf("caughtup/outbox: set drain marker: %w", err)
	}
	if total > 0 {
		r.cfg.Logger.InfoContext(ctx, "caughtup/outbox: drained rows written before the slot", "slot", r.cfg.Slot, "events", total)
	}
	return nil
}

// outboxColumns maps the outbox columns to their positions in a relation.
type outboxColumns struct {
	id, eventID, topic, key, payload, headers, createdAt int
	types                                                []uint32
}

func columnsOf(rel *pglogrepl.RelationMessage) outboxColumns {
	c := outboxColumns{id: -1, eventID: -1, topic: -1, key: -1, payload: -1, headers: -1, createdAt: -1}
	c.types = make([]uint32, len(rel.Columns))
	for i, col := range rel.Columns {
		c.types[i] = col.DataType
		switch col.Name {
		case "id":
			c.id = i
		case "event_id":
			c.eventID = i
		case "topic":
			c.topic = i
		case "key":
			c.key = i
		case "payload":
			c.payload = i
		case "headers":
			c.headers = i
		case "created_at":
			c.createdAt = i
		}
	}
	return c
}

// stream is one replication session's state.
type stream struct {
	r         *LogicalRelay
	conn      *pgconn.PgConn
	epoch     position.Epoch
	typeMap   *pgtype.Map
	relations map[uint32]outboxColumns

	inTx       bool
	txEvents   []Event
	pending    []Event
	pendingEnd pglogrepl.LSN
	flushAt    time.Time
	confirmed  pglogrepl.LSN
	nextStatus time.Time
	published  bool

	cleaner *pgx.Conn
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
		var crash *crashError
		if errors.As(err, &crash) {
			// A simulated crash: drop the socket without a goodbye.
			_ = conn.Conn().Close()
			return
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

// crashError marks a hook's simulated crash.
type crashError struct{ err error }

// Error implements error.
func (e *crashError) Error() string { return "simulated crash: " + e.err.Error() }

// Unwrap returns the hook's error.
func (e *crashError) Unwrap() error { return e.err }

func (s *stream) run(ctx context.Context) error {
	cfg := s.r.cfg
	s.nextStatus = time.Now().Add(cfg.StatusInterval)
	for {
		now := time.Now()
		if s.pendingEnd > s.confirmed && (len(s.pending) >= cfg.MaxBatch || !now.Before(s.flushAt)) {
			if err := s.flush(ctx); err != nil {
				return err
			}
			continue
		}
		if !now.Before(s.nextStatus) {
			if err := s.sendStatus(); err != nil {
				return err
			}
		}
		deadline := s.nextStatus
		if s.pendingEnd > s.confirmed && s.flushAt.Before(deadline) {
			deadline = s.flushAt
		}
		rctx, cancel := context.WithDeadline(ctx, deadline)
		msg, err := s.conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("receive: %w", err)
		}
		switch msg := msg.(type) {
		case *pgproto3.CopyData:
			if err := s.handleCopyData(ctx, msg.Data); err != nil {
				return err
			}
		case *pgproto3.ErrorResponse:
			return pgconn.ErrorResponseToPgError(msg)
		case *pgproto3.CopyDone:
			return errors.New("the server ended the replication stream")
		}
	}
}

func (s *stream) handleCopyData(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return err
		}
		// Between transactions with nothing unpublished, everything below
		// the server's sent position has been handled: confirming it lets
		// the slot release WAL of unrelated traffic, which pgoutput does
		// not send at all.
		if !s.inTx && s.pendingEnd <= s.confirmed && pkm.ServerWALEnd > s.confirmed {
			s.confirmed = pkm.ServerWALEnd
			s.pendingEnd = s.confirmed
		}
		s.r.cfg.Logger.Debug("caughtup/outbox: keepalive", "slot", s.r.cfg.Slot, "server_wal_end", pkm.ServerWALEnd, "reply_requested", pkm.ReplyRequested, "confirmed", s.confirmed)
		if pkm.ReplyRequested {
			return s.sendStatus()
		}
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return err
		}
		return s.handleWAL(ctx, xld.WALData)
	}
	return nil
}

func (s *stream) handleWAL(ctx context.Context, wal []byte) error {
	if len(wal) == 0 {
		return nil
	}
	switch pglogrepl.MessageType(wal[0]) {
	case pglogrepl.MessageTypeRelation, pglogrepl.MessageTypeBegin, pglogrepl.MessageTypeInsert, pglogrepl.MessageTypeCommit:
	default:
		return nil // types, origins, updates, deletes: not ours
	}
	msg, err := pglogrepl.Parse(wal)
	if err != nil {
		return fmt.Errorf("decode pgoutput message %q: %w", wal[0], err)
	}
	switch m := msg.(type) {
	case *pglogrepl.RelationMessage:
		if m.RelationName == s.r.table.name && (s.r.table.schema == "" || m.Namespace == s.r.table.schema) {
			s.relations[m.RelationID] = columnsOf(m)
		}
	case *pglogrepl.BeginMessage:
		s.inTx = true
		s.txEvents = s.txEvents[:0]
	case *pglogrepl.InsertMessage:
		cols, ok := s.relations[m.RelationID]
		if !ok || m.Tuple == nil {
			return nil
		}
		s.txEvents = append(s.txEvents, s.decodeRow(cols, m.Tuple))
	case *pglogrepl.CommitMessage:
		s.inTx = false
		if len(s.txEvents) > 0 {
			st := newStamper(cdc.TransactionToken(s.r.cfg.Database, s.epoch, position.LSN(m.TransactionEndLSN), m.CommitTime))
			for _, ev := range s.txEvents {
				s.pending = append(s.pending, st.stamp(ev))
			}
		}
		s.txEvents = s.txEvents[:0]
		if m.TransactionEndLSN > s.pendingEnd {
			s.pendingEnd = m.TransactionEndLSN
		}
		if s.flushAt.IsZero() {
			s.flushAt = time.Now().Add(s.r.cfg.FlushDelay)
		}
	}
	return nil
}

func (s *stream) decodeRow(c outboxColumns, t *pglogrepl.TupleData) Event {
	var ev Event
	col := func(i int) *pglogrepl.TupleDataColumn {
		if i < 0 || i >= len(t.Columns) || t.Columns[i].DataType != pglogrepl.TupleDataTypeText {
			return nil
		}
		return t.Columns[i]
	}
	if x := col(c.id); x != nil {
		ev.Seq, _ = strconv.ParseInt(string(x.Data), 10, 64)
	}
	if x := col(c.eventID); x != nil {
		ev.ID = string(x.Data)
	}
	if x := col(c.topic); x != nil {
		ev.Topic = string(x.Data)
	}
	if x := col(c.key); x != nil {
		_ = s.typeMap.Scan(c.types[c.key], pgtype.TextFormatCode, x.Data, &ev.Key)
	}
	if x := col(c.payload); x != nil {
		_ = s.typeMap.Scan(c.types[c.payload], pgtype.TextFormatCode, x.Data, &ev.Payload)
	}
	if x := col(c.headers); x != nil {
		ev.Headers = parseHeaders(x.Data)
	}
	if x := col(c.createdAt); x != nil {
		_ = s.typeMap.Scan(c.types[c.createdAt], pgtype.TextFormatCode, x.Data, &ev.CreatedAt)
	}
	return ev
}

// flush publishes the pending transactions and only then confirms their
// end position to the slot.
func (s *stream) flush(ctx context.Context) error {
	events := s.pending
	if h := s.r.hooks.afterClaim; h != nil && len(events) > 0 {
		if err := h(ctx, events); err != nil {
			return &crashError{err}
		}
	}
	if len(events) > 0 {
		began := time.Now()
		if err := s.r.cfg.Publisher.Publish(ctx, events); err != nil {
			return &RelayError{Stage: "publish", Err: err}
		}
		s.r.metrics.published(ctx, len(events), time.Since(began))
		s.published = true
	}
	if h := s.r.hooks.afterPublish; h != nil && len(events) > 0 {
		if err := h(ctx, events); err != nil {
			return &crashError{err}
		}
	}
	s.confirmed = s.pendingEnd
	if err := s.sendStatus(); err != nil {
		return err
	}
	if !s.r.cfg.KeepRows && len(events) > 0 {
		s.deleteRows(ctx, events)
	}
	s.pending = nil
	s.flushAt = time.Time{}
	return nil
}

func (s *stream) sendStatus() error {
	s.nextStatus = time.Now().Add(s.r.cfg.StatusInterval)
	if s.confirmed == 0 {
		return nil
	}
	s.r.cfg.Logger.Debug("caughtup/outbox: confirmed", "slot", s.r.cfg.Slot, "lsn", s.confirmed)
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: s.confirmed, WALFlushPosition: s.confirmed, WALApplyPosition: s.confirmed,
	})
	if err != nil {
		return fmt.Errorf("standby status update: %w", err)
	}
	return nil
}

// deleteRows removes relayed rows. It is housekeeping: a failure is logged
// and the rows stay, harmlessly, because the slot has moved past them.
func (s *stream) deleteRows(ctx context.Context, events []Event) {
	ids := make([]int64, 0, len(events))
	for _, ev := range events {
		if ev.Seq != 0 {
			ids = append(ids, ev.Seq)
		}
	}
	if len(ids) == 0 {
		return
	}
	if s.cleaner == nil || s.cleaner.IsClosed() {
		c, err := pgx.ConnectConfig(ctx, s.r.regular.Copy())
		if err != nil {
			s.r.cfg.Logger.WarnContext(ctx, "caughtup/outbox: cannot delete relayed rows", "error", err)
			return
		}
		s.cleaner = c
	}
	if _, err := s.cleaner.Exec(ctx, "DELETE FROM "+s.r.table.ident()+" WHERE id = ANY($1)", ids); err != nil {
		s.r.cfg.Logger.WarnContext(ctx, "caughtup/outbox: cannot delete relayed rows", "error", err)
	}
}
