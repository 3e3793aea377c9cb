package enqueue

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/caughtup/caughtup/internal/pgwal"
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
	// [A-Za-z0-9_-].
	// Default: DefaultDatabase ("main").
	Database string

	// SystemIDRefresh is how long a connection reuses the system
	// identifier (and WAL geometry) it read before reading it again. The
	// timeline is read on every capture and is not affected. Negative:
	// read it on every capture.
	// Default: DefaultSystemIDRefresh (1 minute).
	// Both are fixed at initdb, so this only matters when a proxy moves a
	// live connection to another cluster.
	SystemIDRefresh time.Duration

	// Now is the clock that stamps Token.CapturedAt, which consumers use to
	// bound waiting and deferral.
	// Default: time.Now.
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

// The SQL lives in internal/pgwal, shared with replay's tracker. In
// short: pg_current_wal_insert_lsn() read after COMMIT has returned is at
// or past the end of the commit record, which a replica's
// pg_last_wal_replay_lsn() must reach before the row is visible there;
// pg_current_wal_lsn() (the write position) can be below it with
// synchronous_commit = off, and a position read inside the transaction is
// below its own commit record. The timeline comes from the current WAL
// file name in the same round trip, exact even right after a failover.
// The control file (system identifier, WAL layout) is read only when the
// connection's cached copy is missing or due.

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
	p, err := withControl(c, conn, now, func(f pgwal.Fields) (pgwal.Primary, error) { return pgwal.ReadPrimary(ctx, conn, f) },
		func(p *pgwal.Primary) *pgwal.ControlFile { return &p.Control })
	if err != nil {
		return position.Token{}, queryError(err)
	}
	return position.New(c.cfg.Database, p.Epoch(), p.InsertEnd(), position.SourcePrimary, now), nil
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
	r, err := withControl(c, conn, now, func(f pgwal.Fields) (pgwal.Replica, error) { return pgwal.ReadReplica(ctx, conn, f) },
		func(r *pgwal.Replica) *pgwal.ControlFile { return &r.Control })
	if err != nil {
		return position.Token{}, queryError(err)
	}
	switch {
	case !r.InRecovery:
		// Not a standby (any more): the insert position, like Capture.
		return position.New(c.cfg.Database, r.Replayed().Epoch, r.Control.WAL.InsertEnd(r.LSN), position.SourcePrimary, now), nil
	case r.LSN == position.InvalidLSN:
		return position.Token{}, ErrNoReplayPosition
	case r.Timeline == 0 && r.ReceiverRunning:
		return position.Token{}, fmt.Errorf("%w: pg_stat_wal_receiver hides received_tli from this role; GRANT pg_read_all_stats TO it", ErrTimelineUnknown)
	case r.Timeline == 0:
		return position.Token{}, fmt.Errorf("%w: the WAL receiver is not running (standby disconnected from its upstream or replaying from an archive); read from another replica or the primary", ErrTimelineUnknown)
	}
	return position.New(c.cfg.Database, r.Replayed().Epoch, r.LSN, position.SourceReplica, now), nil
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

// withControl runs read on conn with the control file (system identifier,
// WAL layout) asked for only when the connection's cached copy is missing
// or due (Config.SystemIDRefresh), and fills the reading's control file,
// which ctl points into, from the cache otherwise.
func withControl[R any](c *Capturer, conn *pgx.Conn, now time.Time, read func(pgwal.Fields) (R, error), ctl func(*R) *pgwal.ControlFile) (R, error) {
	pc := conn.PgConn()
	cachedCtl, cached := c.sysIDs.get(pc, now, c.cfg.SystemIDRefresh)
	fields := pgwal.Control
	if cached {
		fields = 0
	}
	r, err := read(fields)
	if err != nil {
		return r, err
	}
	if cached {
		*ctl(&r) = cachedCtl
	} else {
		c.sysIDs.put(pc, *ctl(&r), now)
	}
	return r, nil
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

// queryError marks a primary read on a standby as ErrNotPrimary.
func queryError(err error) error {
	if errors.Is(err, pgwal.ErrInRecovery) {
		return fmt.Errorf("%w: %w", ErrNotPrimary, err)
	}
	return fmt.Errorf("caughtup/enqueue: reading the WAL position: %w", err)
}
