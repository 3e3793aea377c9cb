package pgwal

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/caughtup/caughtup/position"
)

// Querier runs one query: *pgx.Conn, *pgxpool.Pool, *pgxpool.Conn and
// pgx.Tx all are.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	// ErrInRecovery: a primary-only function ran on a server in recovery
	// (SQLSTATE 55000 from pg_walfile_name or pg_current_wal_insert_lsn).
	// The server's own error is wrapped with it.
	ErrInRecovery = errors.New("caughtup: the server is in recovery (a standby)")

	// ErrHistoryDenied: the role may not read the timeline history file
	// (SQLSTATE 42501); GRANT EXECUTE ON FUNCTION pg_read_file(text) to it
	// (pg_read_server_files only widens which paths it may read), or
	// accept that tokens from older timelines read the primary.
	ErrHistoryDenied = errors.New("caughtup: no permission to read the timeline history file (GRANT EXECUTE ON FUNCTION pg_read_file(text))")
)

// ControlFile is what a server's control file says about it, fixed at initdb:
// pg_control_system().system_identifier and pg_control_init()'s WAL
// geometry.
type ControlFile struct {
	SystemID uint64
	WAL      position.WALLayout
}

// Fields says what a read adds to the position and the timeline.
type Fields uint8

const (
	// Control adds the control file: system identifier and WAL layout,
	// fixed at initdb. Readers that cache it per connection ask for it
	// once in a while; without it Epoch has no SystemID.
	Control Fields = 1 << iota
	// Status adds, on a replica, what a tracker watches besides the
	// position: the replay timestamp and time lag, and the incarnation
	// (postmaster and startup process start times). It costs the server
	// a scan of its backend status array.
	Status
	// Backend adds pg_backend_pid(), the server process that ran the
	// query. Beside the process ID the connection's BackendKeyData gave
	// (pgconn.PgConn.PID) it tells a connection through a pooler, which
	// makes up its own key data for its clients, from a direct one.
	Backend
)

// The control-file columns.
const (
	controlColumns = `,
 (SELECT system_identifier FROM pg_control_system())::text, i.max_data_alignment, i.wal_block_size, i.bytes_per_wal_segment`
	controlFrom = "pg_control_init() AS i"
)

// controlScan holds the scan targets of controlColumns.
type controlScan struct {
	sysID                        string
	maxAlign, blockSize, segSize int64
}

func (c *controlScan) dest() []any {
	return []any{&c.sysID, &c.maxAlign, &c.blockSize, &c.segSize}
}

func (c *controlScan) parse() (ControlFile, error) {
	id, err := position.ParseSystemIdentifier(c.sysID)
	if err != nil {
		return ControlFile{}, err
	}
	if c.maxAlign <= 0 || c.blockSize <= 0 || c.segSize <= 0 {
		return ControlFile{}, fmt.Errorf("caughtup: unexpected pg_control_init() values %d, %d, %d", c.maxAlign, c.blockSize, c.segSize)
	}
	return ControlFile{SystemID: id, WAL: position.WALLayout{MaxAlign: uint64(c.maxAlign), BlockSize: uint64(c.blockSize), SegmentSize: uint64(c.segSize)}}, nil
}

// Primary is what ReadPrimary read.
type Primary struct {
	// InsertLSN is pg_current_wal_insert_lsn() as the server returned it.
	InsertLSN position.LSN
	// Timeline is the current WAL file's timeline.
	Timeline uint32
	// Control is zero unless the read asked for it.
	Control ControlFile
}

// Epoch is the primary's system identifier and timeline; zero in part
// when Control was not read.
func (p Primary) Epoch() position.Epoch {
	return position.Epoch{SystemID: p.Control.SystemID, Timeline: p.Timeline}
}

// InsertEnd is InsertLSN as an end position (position.WALLayout.InsertEnd),
// the form tokens and replay positions have. Without Control it is
// InsertLSN, which is at worst late.
func (p Primary) InsertEnd() position.LSN { return p.Control.WAL.InsertEnd(p.InsertLSN) }

const (
	primaryQuery        = "SELECT pg_current_wal_insert_lsn()::text, pg_walfile_name(pg_current_wal_lsn())"
	primaryQueryControl = primaryQuery + controlColumns + "\nFROM " + controlFrom
)

// ReadPrimary reads the primary's insert position and timeline and, with
// Control in fields, its control file, in one round trip (Status adds
// nothing here). On a standby it returns an error wrapping ErrInRecovery.
//
// Read after COMMIT has returned, on the connection that wrote: the insert
// position is then at or past the commit record. Inside a transaction it
// covers only what others committed before the transaction's snapshot.
func ReadPrimary(ctx context.Context, q Querier, fields Fields) (Primary, error) {
	withControl := fields&Control != 0
	var (
		lsnText, walfile string
		cs               controlScan
		err              error
	)
	if withControl {
		err = q.QueryRow(ctx, primaryQueryControl, pgx.QueryExecModeSimpleProtocol).Scan(append([]any{&lsnText, &walfile}, cs.dest()...)...)
	} else {
		err = q.QueryRow(ctx, primaryQuery, pgx.QueryExecModeSimpleProtocol).Scan(&lsnText, &walfile)
	}
	if err != nil {
		return Primary{}, queryError(err)
	}
	var p Primary
	if p.InsertLSN, err = position.ParseLSN(lsnText); err != nil {
		return Primary{}, err
	}
	if p.Timeline, err = position.TimelineFromWALFileName(walfile); err != nil {
		return Primary{}, err
	}
	if withControl {
		if p.Control, err = cs.parse(); err != nil {
			return Primary{}, err
		}
	}
	return p, nil
}

// Replica is what ReadReplica read. On a server in recovery the position
// is the replay position and the timeline the WAL receiver's; on a server
// that is not (a promoted standby, or a primary used for reads) they are
// ReadPrimary's, which is at or past anything a read there saw.
type Replica struct {
	// InRecovery is pg_is_in_recovery(), evaluated once for the whole row
	// so that a promotion cannot mix the two kinds of columns.
	InRecovery bool
	// LSN is pg_last_wal_replay_lsn() in recovery (0 while it is NULL:
	// nothing replayed yet), else pg_current_wal_insert_lsn().
	LSN position.LSN
	// Timeline is pg_stat_wal_receiver.received_tli in recovery (0 when
	// no receiver runs or the role lacks pg_read_all_stats), else the
	// current WAL file's timeline.
	Timeline uint32
	// ReceiverRunning: in recovery, a WAL receiver process exists. Its pid
	// is visible to every role, its timeline only to pg_read_all_stats, so
	// ReceiverRunning with Timeline 0 means a missing grant.
	ReceiverRunning bool
	// The rest is read with Status only.

	// ReplayTimestamp is pg_last_xact_replay_timestamp(), the primary's
	// commit time of the last replayed transaction; zero if none.
	ReplayTimestamp time.Time
	// TimeLag is the server's clock minus ReplayTimestamp, computed on the
	// server so that client clock skew does not enter it, or 0 while the
	// WAL receiver runs and everything it received is replayed: then
	// nothing waits to be replayed, and on an idle primary the age of the
	// last transaction would grow without the replica being behind (the
	// usual monitoring idiom). TimeLagKnown is false when there is no
	// ReplayTimestamp.
	TimeLag      time.Duration
	TimeLagKnown bool
	// PostmasterStart is pg_postmaster_start_time().
	PostmasterStart time.Time
	// RecoveryStart is when the startup process (the one that replays
	// WAL) started, from pg_stat_get_activity; zero when the server is not
	// in recovery or the role lacks pg_read_all_stats. Unlike
	// PostmasterStart it also changes when the postmaster survives a
	// backend crash and reinitializes, which restarts replay from the last
	// restartpoint.
	RecoveryStart time.Time
	// Control is zero unless the read asked for it.
	Control ControlFile
	// BackendPID is pg_backend_pid(); zero unless the read asked for it
	// (Backend).
	BackendPID uint32
}

// Replayed is the position with its epoch; the epoch is zero in part when
// the timeline or Control is unknown.
func (r Replica) Replayed() position.Replayed {
	return position.Replayed{Epoch: position.Epoch{SystemID: r.Control.SystemID, Timeline: r.Timeline}, LSN: r.LSN}
}

// The replica query. pg_stat_wal_receiver yields no row without a
// receiver, hence the lateral join. Times are microseconds since the Unix
// epoch. The startup process is the only one of its type.
const (
	replicaColumns = `SELECT r,
 (CASE WHEN r THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END)::text,
 CASE WHEN r THEN w.received_tli::text ELSE pg_walfile_name(pg_current_wal_lsn()) END,
 r AND w.pid IS NOT NULL`
	statusColumns = `,
 (extract(epoch FROM pg_last_xact_replay_timestamp()) * 1000000)::int8,
 (extract(epoch FROM CASE
   WHEN pg_last_xact_replay_timestamp() IS NULL THEN NULL
   WHEN r AND w.pid IS NOT NULL AND pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN interval '0'
   ELSE clock_timestamp() - pg_last_xact_replay_timestamp() END) * 1000000)::int8,
 (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8,
 CASE WHEN r THEN (SELECT (extract(epoch FROM a.backend_start) * 1000000)::int8
   FROM pg_stat_get_activity(NULL) a WHERE a.backend_type = 'startup' LIMIT 1) END`
	replicaFrom = `
FROM pg_is_in_recovery() AS r
 LEFT JOIN LATERAL (SELECT received_tli, pid FROM pg_stat_wal_receiver) w ON true`
)

const backendColumns = `,
 pg_backend_pid()`

// replicaQueries by Fields.
var replicaQueries = func() (q [8]string) {
	for f := range Fields(len(q)) {
		cols, from := replicaColumns, replicaFrom
		if f&Status != 0 {
			cols += statusColumns
		}
		if f&Control != 0 {
			cols += controlColumns
			from += ", " + controlFrom
		}
		if f&Backend != 0 {
			cols += backendColumns
		}
		q[f] = cols + from
	}
	return q
}()

// ThroughPooler reports whether a pooler stands between c and the server
// process backendPID (pg_backend_pid(), read on c: Backend) that answered
// on it: a pooler makes up BackendKeyData of its own for its clients, so
// the process c's key data names (pgconn.PgConn.PID) is not the one that
// ran the query. The router (replicapool) and the doctor both judge a
// connection by it.
func ThroughPooler(c *pgconn.PgConn, backendPID uint32) bool {
	return backendPID != c.PID()
}

// ReadReplica reads what a standby has replayed, with its timeline, in one
// round trip; fields adds its control file (Control), its replay lag and
// incarnation (Status) and the server process (Backend). Read it after the
// reads it stands for, on the same connection: replay only moves forward
// within an incarnation.
func ReadReplica(ctx context.Context, q Querier, fields Fields) (Replica, error) {
	fields &= Control | Status | Backend
	var s replicaScan
	dest := s.dest(fields)
	if err := q.QueryRow(ctx, replicaQueries[fields], pgx.QueryExecModeSimpleProtocol).Scan(dest...); err != nil {
		return Replica{}, queryError(err)
	}
	return s.parse(fields)
}

// BeginReadReplica opens a transaction on c and reads, as its first
// statement, what ReadReplica reads, in one round trip (one simple-protocol
// message, so a transaction-mode pooler binds both to one server
// connection and keeps it bound until the transaction ends). Reads made
// later in the transaction run on the server whose position it returns.
// The transaction stays open whatever the outcome, unless the connection
// broke: the caller ends it (ROLLBACK) or closes the connection.
//
// The transaction is READ COMMITTED, so that each later statement takes
// a snapshot of its own, after the position was read: a snapshot taken
// before the read (the first statement's, under REPEATABLE READ) could
// miss what was replayed between the two.
func BeginReadReplica(ctx context.Context, c *pgconn.PgConn, fields Fields) (Replica, error) {
	fields &= Control | Status | Backend
	results, err := c.Exec(ctx, "BEGIN ISOLATION LEVEL READ COMMITTED;\n"+replicaQueries[fields]).ReadAll()
	if err != nil {
		return Replica{}, queryError(err)
	}
	if len(results) != 2 || len(results[1].Rows) != 1 {
		return Replica{}, fmt.Errorf("caughtup: the replica query in a transaction returned %d results", len(results))
	}
	var s replicaScan
	dest := s.dest(fields)
	if err := scanText(results[1].Rows[0], dest); err != nil {
		return Replica{}, err
	}
	return s.parse(fields)
}

// replicaScan holds the scan targets of a replica query.
type replicaScan struct {
	r                                     Replica
	lsnText, tliText                      *string
	replayTS, lag, pmStart, recoveryStart *int64
	backend                               int64
	cs                                    controlScan
}

// dest is the scan targets of replicaQueries[fields], in column order.
func (s *replicaScan) dest(fields Fields) []any {
	dest := []any{&s.r.InRecovery, &s.lsnText, &s.tliText, &s.r.ReceiverRunning}
	if fields&Status != 0 {
		dest = append(dest, &s.replayTS, &s.lag, &s.pmStart, &s.recoveryStart)
	}
	if fields&Control != 0 {
		dest = append(dest, s.cs.dest()...)
	}
	if fields&Backend != 0 {
		dest = append(dest, &s.backend)
	}
	return dest
}

// parse checks and converts what was scanned.
func (s *replicaScan) parse(fields Fields) (Replica, error) {
	r := s.r
	var err error
	if s.lsnText != nil {
		if r.LSN, err = position.ParseLSN(*s.lsnText); err != nil {
			return Replica{}, err
		}
	} else if !r.InRecovery {
		return Replica{}, errors.New("caughtup: pg_current_wal_insert_lsn() returned NULL")
	}
	switch {
	case s.tliText == nil && !r.InRecovery:
		return Replica{}, errors.New("caughtup: pg_walfile_name returned NULL")
	case s.tliText == nil:
	case r.InRecovery:
		if r.Timeline, err = ParseTimeline(*s.tliText); err != nil {
			return Replica{}, err
		}
	default:
		if r.Timeline, err = position.TimelineFromWALFileName(*s.tliText); err != nil {
			return Replica{}, err
		}
	}
	if s.replayTS != nil {
		r.ReplayTimestamp = time.UnixMicro(*s.replayTS)
	}
	if s.lag != nil {
		r.TimeLag, r.TimeLagKnown = time.Duration(*s.lag)*time.Microsecond, true
	}
	if s.pmStart != nil {
		r.PostmasterStart = time.UnixMicro(*s.pmStart)
	}
	if s.recoveryStart != nil {
		r.RecoveryStart = time.UnixMicro(*s.recoveryStart)
	}
	if fields&Control != 0 {
		if r.Control, err = s.cs.parse(); err != nil {
			return Replica{}, err
		}
	}
	if fields&Backend != 0 {
		if s.backend <= 0 || s.backend > math.MaxUint32 {
			return Replica{}, fmt.Errorf("caughtup: unexpected pg_backend_pid() %d", s.backend)
		}
		r.BackendPID = uint32(s.backend)
	}
	return r, nil
}

// scanText scans one row of text-format values, as the simple protocol
// returns them, into the kinds of targets replicaScan uses: *bool, *int64,
// *string and, for columns that may be NULL, **string and **int64.
func scanText(row [][]byte, dest []any) error {
	if len(row) != len(dest) {
		return fmt.Errorf("caughtup: the replica query returned %d columns, want %d", len(row), len(dest))
	}
	for i, v := range row {
		var err error
		switch d := dest[i].(type) {
		case *bool:
			switch string(v) {
			case "t":
				*d = true
			case "f":
				*d = false
			default:
				err = fmt.Errorf("caughtup: column %d: %q is not a boolean", i+1, v)
			}
		case *int64:
			if v == nil {
				return fmt.Errorf("caughtup: column %d is NULL", i+1)
			}
			*d, err = strconv.ParseInt(string(v), 10, 64)
		case *string:
			if v == nil {
				return fmt.Errorf("caughtup: column %d is NULL", i+1)
			}
			*d = string(v)
		case **string:
			*d = nil
			if v != nil {
				s := string(v)
				*d = &s
			}
		case **int64:
			*d = nil
			if v != nil {
				var n int64
				n, err = strconv.ParseInt(string(v), 10, 64)
				*d = &n
			}
		default:
			return fmt.Errorf("caughtup: column %d: cannot scan into %T", i+1, d)
		}
		if err != nil {
			return fmt.Errorf("caughtup: column %d: %w", i+1, err)
		}
	}
	return nil
}

// ParseTimeline reads a timeline ID printed in decimal, as
// pg_stat_wal_receiver.received_tli and history files print it; 0 is not a
// timeline.
func ParseTimeline(s string) (uint32, error) {
	v, err := strconv.ParseUint(s, 10, 32)
	if err != nil || v == 0 {
		return 0, &position.SyntaxError{What: "timeline", Input: s}
	}
	return uint32(v), nil
}

const historyQuery = `SELECT pg_read_file('pg_wal/' || lpad(to_hex($1::int), 8, '0') || '.history')`

// ReadHistory reads the history file of timeline tli (which must be above
// 1; timeline 1 has no history) from the server's pg_wal: the ancestors of
// tli with their switchpoints. It needs EXECUTE on pg_read_file(text) (or
// superuser); without it the error wraps ErrHistoryDenied.
func ReadHistory(ctx context.Context, q Querier, tli uint32) (position.History, error) {
	if tli < 2 {
		return nil, nil
	}
	var text string
	if err := q.QueryRow(ctx, historyQuery, pgx.QueryExecModeSimpleProtocol, int64(tli)).Scan(&text); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege {
			return nil, fmt.Errorf("%w: %w", ErrHistoryDenied, err)
		}
		return nil, err
	}
	return position.ParseHistory(text)
}

// queryError marks the server's "recovery is in progress" (SQLSTATE 55000
// from the WAL control functions on a standby) as ErrInRecovery.
func queryError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectNotInPrerequisiteState {
		return fmt.Errorf("%w: %w", ErrInRecovery, err)
	}
	return err
}
