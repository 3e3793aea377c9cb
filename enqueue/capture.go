package enqueue

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/caughtup/caughtup/position"
)

// DefaultDatabase is the logical database name of the package-level
// functions and of a Config that names none.
const DefaultDatabase = "main"

// DefaultSystemIDRefresh is how long a connection's system identifier is
// reused when Config.SystemIDRefresh is zero.
const DefaultSystemIDRefresh = time.Minute

// Config configures a Capturer. The zero Config is valid.
type Config struct {
	// Database is the logical name under which positions enter the token,
	// the key consumers use to find this database's primary and replicas.
	// It need not be the PostgreSQL database name. 1 to 63 of
	// [A-Za-z0-9_-]. Default "main".
	Database string

	// SystemIDRefresh is how long a connection reuses the system
	// identifier (and WAL geometry) it read before reading it again. Both
	// are fixed at initdb, so this only matters when a proxy moves a live
	// connection to another cluster. The timeline is read on every capture
	// and is not affected. Negative: read it on every capture. Default
	// DefaultSystemIDRefresh (1 minute).
	SystemIDRefresh time.Duration

	// Now is the clock that stamps Token.CapturedAt, which consumers use to
	// bound waiting and deferral. Default time.Now.
	Now func() time.Time
}

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.Database == "" {
		c.Database = DefaultDatabase
	}
	if c.SystemIDRefresh == 0 {
		c.SystemIDRefresh = DefaultSystemIDRefresh
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// Validate reports a Config that NewCapturer would reject.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if !position.ValidDatabaseName(c.Database) {
		return fmt.Errorf("caughtup/enqueue: Config.Database %q must be 1 to %d of [A-Za-z0-9_-]", c.Database, position.MaxDatabaseNameLen)
	}
	return nil
}

// Capturer reads WAL positions for one logical database and turns them into
// tokens. It is safe for concurrent use; make one per logical database at
// startup and share it.
type Capturer struct {
	cfg    Config
	sysIDs sysIDCache
}

// NewCapturer returns a Capturer for cfg. It panics if cfg.Validate fails:
// the configuration is static, and a bad database name is a programming
// error best found at startup.
func NewCapturer(cfg Config) *Capturer {
	if err := cfg.Validate(); err != nil {
		panic(err)
	}
	return &Capturer{cfg: cfg.WithDefaults()}
}

// Database returns the logical database name the capturer stamps.
func (c *Capturer) Database() string { return c.cfg.Database }

// The capture queries run in the simple protocol: one round trip, no
// prepared statement (so they also work through transaction-pooling
// proxies), and text results that are parsed here exactly.
//
// Why pg_current_wal_insert_lsn() after COMMIT has returned: it is where
// the next record will go, so it is at or past the end of the commit
// record, which pg_last_wal_replay_lsn() on a replica must reach before the
// row is visible there. pg_current_wal_lsn() is the *write* position and,
// with synchronous_commit = off, can still be below the commit record when
// COMMIT returns. A position read inside the transaction is below its own
// commit record: a replica can pass it while the row is still invisible.
// (position.WALLayout.InsertEnd then moves it back from just past a page header to the page
// boundary, where replay positions are.)
//
// The primary's timeline is read in the same query from the WAL file name
// of the current position (its first 8 hex digits). It cannot change under
// a primary, so reading both together makes the epoch exact even right
// after a failover, unlike pg_control_checkpoint().timeline_id, which lags
// a promotion until the next checkpoint.
//
// The control-file columns (system identifier, WAL layout) are added only
// when the connection's cached copy is missing or due.
const (
	primaryQuery   = "SELECT pg_current_wal_insert_lsn()::text, pg_walfile_name(pg_current_wal_lsn())"
	controlColumns = ",\n (SELECT system_identifier FROM pg_control_system())::text, i.max_data_alignment, i.wal_block_size, i.bytes_per_wal_segment"
	controlFrom    = "pg_control_init() AS i"

	primaryQueryControl = primaryQuery + controlColumns + "\nFROM " + controlFrom

	// On a standby: the replay position and the timeline the WAL receiver
	// is on. pg_is_in_recovery() is evaluated once (FROM), so a promotion
	// between columns cannot mix the two branches; a server that is not in
	// recovery (a promoted standby, or a primary used for reads) answers
	// like Capture, which is at or past anything a read there saw.
	replicaQuery = `SELECT r,
 CASE WHEN r THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END::text,
 CASE WHEN r THEN (SELECT received_tli FROM pg_stat_wal_receiver)::text ELSE pg_walfile_name(pg_current_wal_lsn()) END,
 r AND (SELECT pid FROM pg_stat_wal_receiver) IS NOT NULL`
	replicaFrom = "\nFROM pg_is_in_recovery() AS r"

	replicaQueryCached  = replicaQuery + replicaFrom
	replicaQueryControl = replicaQuery + controlColumns + replicaFrom + ", " + controlFrom
)

// control holds the scan targets of controlColumns.
type control struct {
	sysID                        string
	maxAlign, blockSize, segSize int64
}

func (ct *control) dest() []any {
	return []any{&ct.sysID, &ct.maxAlign, &ct.blockSize, &ct.segSize}
}

func (ct *control) server() (server, error) {
	id, err := position.ParseSystemIdentifier(ct.sysID)
	if err != nil {
		return server{}, err
	}
	if ct.maxAlign <= 0 || ct.blockSize <= 0 || ct.segSize <= 0 {
		return server{}, fmt.Errorf("caughtup/enqueue: unexpected pg_control_init() values %d, %d, %d", ct.maxAlign, ct.blockSize, ct.segSize)
	}
	return server{sysID: id, layout: position.WALLayout{MaxAlign: uint64(ct.maxAlign), BlockSize: uint64(ct.blockSize), SegmentSize: uint64(ct.segSize)}}, nil
}

// Capture returns a token for the write that just committed on conn: the
// primary's pg_current_wal_insert_lsn() and epoch, with SourcePrimary.
//
// Call it after COMMIT has returned (or after an autocommit statement), on
// the same connection, so that the position is read on the server that ran
// the write and after its commit record; Commit and InTx do this for you.
// A connection still inside a transaction returns ErrInTransaction, a
// standby ErrNotPrimary.
//
// It costs one round trip. The position is an end position like a
// replica's pg_last_wal_replay_lsn() (see the package documentation). The
// timeline is read every time; the system identifier is cached per
// connection (Config.SystemIDRefresh) and added to that query when due.
//
// The token covers all WAL inserted when it is read, including other
// sessions' records that may not be flushed yet. It is never early, but on
// a quiet primary a replica reaches it only at the next flush (the next
// commit anywhere, or the background writer within about 15 s).
func (c *Capturer) Capture(ctx context.Context, conn *pgx.Conn) (position.Token, error) {
	if err := checkIdle(conn); err != nil {
		return position.Token{}, err
	}
	return c.capture(ctx, conn)
}

// CaptureCommitted returns a token for every row that tx's snapshot shows
// as committed by other transactions: the insert position read now, inside
// tx, is at or past each of their commit records, because they committed
// before the snapshot was taken. Relays that read an outbox call it after
// the statement that claimed the rows. It says nothing about tx's own
// writes, whose commit record does not exist yet: for those, use Commit.
func (c *Capturer) CaptureCommitted(ctx context.Context, tx pgx.Tx) (position.Token, error) {
	if tx == nil || tx.Conn() == nil {
		return position.Token{}, errors.New("caughtup/enqueue: CaptureCommitted on a nil transaction")
	}
	return c.capture(ctx, tx.Conn())
}

// capture reads the position and the epoch on conn; see Capture.
func (c *Capturer) capture(ctx context.Context, conn *pgx.Conn) (position.Token, error) {
	now := c.cfg.Now()
	pc := conn.PgConn()
	srv, cached := c.sysIDs.get(pc, now, c.cfg.SystemIDRefresh)

	var lsnText, walfile string
	var ct control
	var err error
	if cached {
		err = conn.QueryRow(ctx, primaryQuery, pgx.QueryExecModeSimpleProtocol).Scan(&lsnText, &walfile)
	} else {
		err = conn.QueryRow(ctx, primaryQueryControl, pgx.QueryExecModeSimpleProtocol).Scan(append([]any{&lsnText, &walfile}, ct.dest()...)...)
	}
	if err != nil {
		return position.Token{}, queryError(err)
	}
	if !cached {
		if srv, err = ct.server(); err != nil {
			return position.Token{}, err
		}
		c.sysIDs.put(pc, srv, now)
	}
	lsn, err := position.ParseLSN(lsnText)
	if err != nil {
		return position.Token{}, err
	}
	tli, err := position.TimelineFromWALFileName(walfile)
	if err != nil {
		return position.Token{}, err
	}
	epoch := position.Epoch{SystemID: srv.sysID, Timeline: tli}
	return position.New(c.cfg.Database, epoch, srv.layout.InsertEnd(lsn), position.SourcePrimary, now), nil
}

// AfterWrite is Capture that merges the token into ctx (see WithToken), for
// autocommit writes: call it after the statement has returned. On error ctx
// is returned unchanged.
func (c *Capturer) AfterWrite(ctx context.Context, conn *pgx.Conn) (context.Context, error) {
	tok, err := c.Capture(ctx, conn)
	if err != nil {
		return ctx, err
	}
	return WithToken(ctx, tok), nil
}

// ReplicaRead returns a token for what a read on conn, a replica, has
// seen: the replica's pg_last_wal_replay_lsn() and epoch (system identifier
// and pg_stat_wal_receiver.received_tli), with SourceReplica. A job that
// acts on data the producer read from a replica carries it, so the job does
// not run on a replica that is further behind than that read (GitLab's
// replica-sourced location).
//
// Call it after the reads it stands for, on the same connection: replay
// only moves forward, so a position read afterwards covers everything they
// saw. If the server is not in recovery (a promoted standby, or a primary
// used for reads) the token is Capture's, with SourcePrimary.
//
// The role needs pg_read_all_stats on the standby, or
// pg_stat_wal_receiver hides the timeline and ReplicaRead returns
// ErrTimelineUnknown; so does a standby whose WAL receiver is not running.
func (c *Capturer) ReplicaRead(ctx context.Context, conn *pgx.Conn) (position.Token, error) {
	if conn == nil {
		return position.Token{}, errors.New("caughtup/enqueue: ReplicaRead on a nil connection")
	}
	now := c.cfg.Now()
	pc := conn.PgConn()
	srv, cached := c.sysIDs.get(pc, now, c.cfg.SystemIDRefresh)

	var (
		inRecovery, receiver bool
		lsnText, tliText     *string
		ct                   control
		err                  error
	)
	if cached {
		err = conn.QueryRow(ctx, replicaQueryCached, pgx.QueryExecModeSimpleProtocol).Scan(&inRecovery, &lsnText, &tliText, &receiver)
	} else {
		err = conn.QueryRow(ctx, replicaQueryControl, pgx.QueryExecModeSimpleProtocol).Scan(append([]any{&inRecovery, &lsnText, &tliText, &receiver}, ct.dest()...)...)
	}
	if err != nil {
		return position.Token{}, queryError(err)
	}
	if !cached {
		if srv, err = ct.server(); err != nil {
			return position.Token{}, err
		}
		c.sysIDs.put(pc, srv, now)
	}
	if lsnText == nil {
		return position.Token{}, ErrNoReplayPosition
	}
	lsn, err := position.ParseLSN(*lsnText)
	if err != nil {
		return position.Token{}, err
	}
	source := position.SourceReplica
	var tli uint32
	switch {
	case !inRecovery:
		source = position.SourcePrimary
		lsn = srv.layout.InsertEnd(lsn)
		if tliText == nil {
			return position.Token{}, fmt.Errorf("caughtup/enqueue: pg_walfile_name returned NULL")
		}
		if tli, err = position.TimelineFromWALFileName(*tliText); err != nil {
			return position.Token{}, err
		}
	case tliText == nil && receiver:
		return position.Token{}, fmt.Errorf("%w: pg_stat_wal_receiver hides received_tli from this role; GRANT pg_read_all_stats TO it", ErrTimelineUnknown)
	case tliText == nil:
		return position.Token{}, fmt.Errorf("%w: the WAL receiver is not running (standby disconnected from its upstream or replaying from an archive); read from another replica or the primary", ErrTimelineUnknown)
	default:
		v, perr := strconv.ParseUint(*tliText, 10, 32)
		if perr != nil || v == 0 {
			return position.Token{}, fmt.Errorf("caughtup/enqueue: unexpected received_tli %q", *tliText)
		}
		tli = uint32(v)
	}
	return position.New(c.cfg.Database, position.Epoch{SystemID: srv.sysID, Timeline: tli}, lsn, source, now), nil
}

// AfterReplicaRead is ReplicaRead that merges the token into ctx (see
// WithToken). On error ctx is returned unchanged.
func (c *Capturer) AfterReplicaRead(ctx context.Context, conn *pgx.Conn) (context.Context, error) {
	tok, err := c.ReplicaRead(ctx, conn)
	if err != nil {
		return ctx, err
	}
	return WithToken(ctx, tok), nil
}

// checkIdle refuses a connection inside a transaction block: a position
// read there is below the transaction's own commit record.
func checkIdle(conn *pgx.Conn) error {
	if conn == nil {
		return errors.New("caughtup/enqueue: Capture on a nil connection")
	}
	switch conn.PgConn().TxStatus() {
	case 'T', 'E':
		return ErrInTransaction
	}
	return nil
}

// queryError marks the server's "recovery is in progress" (SQLSTATE 55000
// from the WAL control functions on a standby) as ErrNotPrimary.
func queryError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55000" {
		return fmt.Errorf("%w: %w", ErrNotPrimary, err)
	}
	return fmt.Errorf("caughtup/enqueue: reading the WAL position: %w", err)
}
