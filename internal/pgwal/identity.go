package pgwal

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/caughtup/caughtup/position"
)

// Identity is what a server says about itself on one connection (design
// notes, "What a server says about itself"): enough to tell whether two
// connections reached the same server, and whether it is a standby, of
// which cluster, receiving from where.
type Identity struct {
	// SystemID is pg_control_system().system_identifier, when
	// SystemIDKnown: the role may execute pg_control_system(). Without
	// that right the function fails the whole query even inside a CASE
	// (PostgreSQL checks EXECUTE when it plans the statement), so it is
	// asked for separately, only when has_function_privilege allows it.
	SystemID      uint64
	SystemIDKnown bool
	// Addr and Port are inet_server_addr() and inet_server_port(): the
	// server's own end of the connection, which through a TCP proxy or
	// PgBouncer is the server's address, not the proxy's. Empty and 0 over
	// a Unix socket.
	Addr string
	Port int
	// PostmasterStart is pg_postmaster_start_time(): it tells apart two
	// servers behind one address, and one server before and after a
	// restart.
	PostmasterStart time.Time
	// InRecovery is pg_is_in_recovery().
	InRecovery bool
	// ServerVersion is server_version_num, e.g. 150014.
	ServerVersion int
	// Receiver is what pg_stat_wal_receiver shows; zero on a primary.
	Receiver Receiver
}

// Receiver is a standby's WAL receiver as pg_stat_wal_receiver shows it.
// Its pid is visible to every role, everything else only to roles with
// pg_read_all_stats' privileges: Running with an empty Status means the
// role lacks them. The receiver's timeline is Replica.Timeline
// (ReadReplica).
type Receiver struct {
	// Running: a WAL receiver process exists.
	Running bool
	// Status is its status ("streaming", "stopping", …); empty when no
	// receiver runs or the role may not see it.
	Status string
	// SenderHost and SenderPort are the server it receives from (the
	// primary, or an upstream standby when cascading); empty and 0 when
	// hidden.
	SenderHost string
	SenderPort int
}

// Same reports whether a and b are the same server in the same run:
// addresses, start time and, when both know it, system identifier. The
// replay position may differ between two reads of one standby.
func (a Identity) Same(b Identity) bool {
	if a.SystemIDKnown && b.SystemIDKnown && a.SystemID != b.SystemID {
		return false
	}
	return a.Addr == b.Addr && a.Port == b.Port && a.PostmasterStart.Equal(b.PostmasterStart)
}

// Server names the server for people: address, system identifier (when
// known) and start time.
func (a Identity) Server() string {
	addr := "unix socket"
	if a.Addr != "" {
		addr = joinHostPort(a.Addr, a.Port)
	}
	s := addr + " ("
	if a.SystemIDKnown {
		s += fmt.Sprintf("system %d, ", a.SystemID)
	}
	return s + "up since " + a.PostmasterStart.UTC().Format(time.RFC3339) + ")"
}

func joinHostPort(host string, port int) string {
	if strings.Contains(host, ":") {
		return fmt.Sprintf("[%s]:%d", host, port)
	}
	return fmt.Sprintf("%s:%d", host, port)
}

// The identity query. pg_stat_wal_receiver has no row without a receiver,
// hence the outer join on a one-row relation. host() drops the /32 of
// the inet.
const (
	identityQuery = `SELECT has_function_privilege('pg_control_system()', 'EXECUTE'),
 host(inet_server_addr()), inet_server_port(),
 (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8,
 pg_is_in_recovery(), current_setting('server_version_num')::int4,
 w.pid IS NOT NULL, w.status, w.sender_host, w.sender_port
FROM (SELECT) AS one LEFT JOIN pg_stat_wal_receiver w ON true`
	systemIDQuery = `SELECT system_identifier::text FROM pg_control_system()`
)

// ReadIdentity reads what the server says about itself: one round trip,
// two when the role may read the system identifier. Run it inside a
// transaction to be sure both reads reach one server through a pooler.
func ReadIdentity(ctx context.Context, q Querier) (Identity, error) {
	var (
		id                 Identity
		mayControl         bool
		addr, status, host *string
		port, senderPort   *int32
		start              int64
		version            int32
	)
	if err := q.QueryRow(ctx, identityQuery, pgx.QueryExecModeSimpleProtocol).Scan(&mayControl, &addr, &port, &start,
		&id.InRecovery, &version, &id.Receiver.Running, &status, &host, &senderPort); err != nil {
		return Identity{}, err
	}
	id.PostmasterStart, id.ServerVersion = time.UnixMicro(start), int(version)
	if addr != nil && port != nil {
		id.Addr, id.Port = *addr, int(*port)
	}
	if status != nil {
		id.Receiver.Status = *status
	}
	if host != nil {
		id.Receiver.SenderHost = *host
	}
	if senderPort != nil {
		id.Receiver.SenderPort = int(*senderPort)
	}
	if !mayControl {
		return id, nil
	}
	var text string
	if err := q.QueryRow(ctx, systemIDQuery, pgx.QueryExecModeSimpleProtocol).Scan(&text); err != nil {
		return Identity{}, err
	}
	sys, err := position.ParseSystemIdentifier(text)
	if err != nil {
		return Identity{}, err
	}
	id.SystemID, id.SystemIDKnown = sys, true
	return id, nil
}

const clockQuery = `SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8`

// ReadClock reads the server's clock (clock_timestamp(), to the
// microsecond) in one short round trip, for measuring clock skew against
// the local clock around the call.
func ReadClock(ctx context.Context, q Querier) (time.Time, error) {
	var us int64
	if err := q.QueryRow(ctx, clockQuery, pgx.QueryExecModeSimpleProtocol).Scan(&us); err != nil {
		return time.Time{}, err
	}
	return time.UnixMicro(us), nil
}

// ReadSettings reads the current values of the named settings as SHOW
// prints them ("30s", "off"). Every role may read these; an unknown name
// is an error.
func ReadSettings(ctx context.Context, q Querier, names ...string) (map[string]string, error) {
	if len(names) == 0 {
		return map[string]string{}, nil
	}
	var b strings.Builder
	b.WriteString("SELECT ")
	for i, n := range names {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("current_setting(" + quoteLiteral(n) + ")")
	}
	vals := make([]string, len(names))
	dest := make([]any, len(names))
	for i := range vals {
		dest[i] = &vals[i]
	}
	if err := q.QueryRow(ctx, b.String(), pgx.QueryExecModeSimpleProtocol).Scan(dest...); err != nil {
		return nil, err
	}
	out := make(map[string]string, len(names))
	for i, n := range names {
		out[n] = vals[i]
	}
	return out, nil
}

// quoteLiteral quotes s as an SQL string literal; the simple protocol has
// no parameters of its own, and these queries are built from constants
// and setting names.
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// Need says what is lost without a privilege.
type Need uint8

const (
	// Required: a read of this package fails, or returns a replica that
	// caughtup must treat as unknown, without it.
	Required Need = iota + 1
	// Degraded: the reads work, with something less (Privilege.Lost).
	Degraded
)

// Privilege is one right a role needs for this package's reads.
type Privilege struct {
	// Function is a signature as has_function_privilege and GRANT take it,
	// e.g. "pg_control_system()"; empty for the others.
	Function string
	// View is a view the reads select from; empty for the others.
	View string
	// Role is a predefined role whose privileges the role must have (as a
	// member that inherits them, directly or through e.g. pg_monitor).
	Role string
	// Database is a database the role must be allowed to connect to
	// (CONNECT); empty for the others. It is not in Privileges: a role
	// without it never runs a query, so MissingPrivilege finds it in the
	// connection's error (ConnectPrivilege).
	Database string
	// Need says how much is lost without it, Lost says what.
	Need Need
	Lost string
}

// Name is the privilege as people say it: "EXECUTE on
// pg_control_system()", "SELECT on pg_stat_wal_receiver",
// "pg_read_all_stats", "CONNECT on database app".
func (p Privilege) Name() string {
	switch {
	case p.Function != "":
		return "EXECUTE on " + p.Function
	case p.View != "":
		return "SELECT on " + p.View
	case p.Database != "":
		return "CONNECT on database " + p.Database
	}
	return p.Role
}

// GrantSQL is the statement that gives role the privilege, to run on the
// primary (standbys replay it).
func (p Privilege) GrantSQL(role string) string {
	r := pgx.Identifier{role}.Sanitize()
	switch {
	case p.Function != "":
		return "GRANT EXECUTE ON FUNCTION " + p.Function + " TO " + r + ";"
	case p.View != "":
		return "GRANT SELECT ON " + p.View + " TO " + r + ";"
	case p.Database != "":
		return "GRANT CONNECT ON DATABASE " + pgx.Identifier{p.Database}.Sanitize() + " TO " + r + ";"
	}
	return "GRANT " + p.Role + " TO " + r + ";"
}

// ConnectPrivilege is CONNECT on database, which a role has through
// PUBLIC unless it was revoked (hardened installations revoke it and grant
// it per role).
func ConnectPrivilege(database string) Privilege {
	return Privilege{Database: database, Need: Required, Lost: lostConnect}
}

// What the reads lose without a privilege.
const (
	lostPrimary = "ReadPrimary fails: no token can be captured and the primary's position is unknown"
	lostReplica = "ReadReplica fails: the replica's position is unknown and caughtup never uses it"
	lostControl = "reads with Control fail: no epoch, so tokens cannot be captured and replicas are unknown"
	lostStatus  = "reads with Status fail: trackers cannot poll replicas"
	lostConnect = "the server refuses every connection of the role: the node's position is unknown and caughtup never uses it (a primary's: no token can be captured)"
	lostHistory = "the timeline history after a failover: tokens from older timelines then read the primary, and a standby left on an older timeline is not recognized as diverged"
)

// Privileges lists every function, view and role this package's queries
// use, with what is lost without each. Most are PUBLIC by default;
// hardened installations revoke some, and the default grants differ by
// version, so they are all checked. ReadIdentity's extras
// (inet_server_addr, pg_stat_wal_receiver's status) are here too.
var Privileges = []Privilege{
	{Function: "pg_current_wal_insert_lsn()", Need: Required, Lost: lostPrimary},
	{Function: "pg_current_wal_lsn()", Need: Required, Lost: lostPrimary},
	{Function: "pg_walfile_name(pg_lsn)", Need: Required, Lost: lostPrimary},
	{Function: "pg_control_system()", Need: Required, Lost: lostControl},
	{Function: "pg_control_init()", Need: Required, Lost: lostControl},
	{Function: "pg_is_in_recovery()", Need: Required, Lost: lostReplica},
	{Function: "pg_last_wal_replay_lsn()", Need: Required, Lost: lostReplica},
	{Function: "pg_stat_get_wal_receiver()", Need: Required, Lost: lostReplica},
	{View: "pg_stat_wal_receiver", Need: Required, Lost: lostReplica},
	{Function: "pg_last_wal_receive_lsn()", Need: Required, Lost: lostStatus},
	{Function: "pg_last_xact_replay_timestamp()", Need: Required, Lost: lostStatus},
	{Function: "pg_postmaster_start_time()", Need: Required, Lost: lostStatus},
	{Function: "pg_stat_get_activity(integer)", Need: Required, Lost: lostStatus},
	{Function: "inet_server_addr()", Need: Required, Lost: "ReadIdentity fails: which server a connection reached is unknown"},
	{Function: "inet_server_port()", Need: Required, Lost: "ReadIdentity fails: which server a connection reached is unknown"},
	// Without it pg_stat_wal_receiver shows only the pid: no received_tli,
	// so no epoch, and the replica is unknown; no startup process either,
	// so no RecoveryStart.
	ReadAllStats,
	// ReadHistory reads pg_wal/<tli>.history, inside the data directory:
	// EXECUTE on pg_read_file(text) is what it needs. pg_read_server_files
	// only lifts the restriction to the data directory and, without
	// EXECUTE, does not help.
	{Function: "pg_read_file(text)", Need: Degraded, Lost: lostHistory + " (it lets the role read any file in the data directory)"},
}

// RoleRights is what ReadRights found about the connection's role.
type RoleRights struct {
	// Role is current_user.
	Role string
	// Superuser: the role has every privilege.
	Superuser bool
	// Missing are the Privileges the role lacks, in their order.
	Missing []Privilege
	// NoInherit lists the roles of Missing that the role is a member of
	// without inheriting their privileges (ALTER ROLE … INHERIT, or on
	// PostgreSQL 16+ a grant WITH INHERIT TRUE, fixes those).
	NoInherit []string
}

// MissingAt returns the privileges of Missing with the given need.
func (r RoleRights) MissingAt(need Need) []Privilege {
	var out []Privilege
	for _, p := range r.Missing {
		if p.Need == need {
			out = append(out, p)
		}
	}
	return out
}

// rightsQuery asks about every entry of Privileges in one row, in order:
// one column per function or view, two per role (privileges, membership).
func rightsQuery() string {
	var b strings.Builder
	b.WriteString("SELECT current_user::text, current_setting('is_superuser') = 'on'")
	for _, p := range Privileges {
		switch {
		case p.Function != "":
			b.WriteString(",\n has_function_privilege(" + quoteLiteral(p.Function) + ", 'EXECUTE')")
		case p.View != "":
			b.WriteString(",\n has_table_privilege(" + quoteLiteral(p.View) + ", 'SELECT')")
		default:
			b.WriteString(",\n pg_has_role(" + quoteLiteral(p.Role) + ", 'USAGE'), pg_has_role(" + quoteLiteral(p.Role) + ", 'MEMBER')")
		}
	}
	return b.String()
}

// columns is how many columns rightsQuery spends on p.
func columns(p Privilege) int {
	if p.Function == "" && p.View == "" {
		return 2
	}
	return 1
}

// ReadRights reads which of Privileges the connection's role lacks, in
// one round trip. A superuser lacks none.
func ReadRights(ctx context.Context, q Querier) (RoleRights, error) {
	var r RoleRights
	n := 0
	for _, p := range Privileges {
		n += columns(p)
	}
	has := make([]bool, n)
	dest := []any{&r.Role, &r.Superuser}
	for i := range has {
		dest = append(dest, &has[i])
	}
	if err := q.QueryRow(ctx, rightsQuery(), pgx.QueryExecModeSimpleProtocol).Scan(dest...); err != nil {
		return RoleRights{}, err
	}
	i := 0
	for _, p := range Privileges {
		ok := has[i]
		if columns(p) == 2 && !ok && has[i+1] {
			r.NoInherit = append(r.NoInherit, p.Role)
		}
		i += columns(p)
		if !ok {
			r.Missing = append(r.Missing, p)
		}
	}
	return r, nil
}

// MissingPrivilege returns the privilege an error says the role lacks:
// for SQLSTATE 42501 from a query, the function the message names
// ("permission denied for function pg_control_system"), or the view; from
// connecting (a *pgconn.ConnectError: "permission denied for database",
// which the server sends before any query), CONNECT on the database the
// connection asked for. False for any other error or one that names
// nothing this package uses.
func MissingPrivilege(err error) (Privilege, bool) {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != pgerrcode.InsufficientPrivilege {
		return Privilege{}, false
	}
	if ce := (*pgconn.ConnectError)(nil); errors.As(err, &ce) {
		return connectPrivilege(ce, pe)
	}
	for _, p := range Privileges {
		name := p.Function
		if i := strings.IndexByte(name, '('); i >= 0 {
			name = name[:i]
		}
		if name == "" {
			name = p.View
		}
		if name != "" && strings.Contains(pe.Message, " "+name) {
			return p, true
		}
	}
	return Privilege{}, false
}

// connectPrivilege is the CONNECT privilege a refused connection lacks.
// Other 42501s at connect time (a walsender without REPLICATION, a startup
// option only a superuser may set) are not CONNECT: the server's message
// says "permission denied for database" with the detail "User does not
// have CONNECT privilege.", the detail naming the keyword even when the
// message is translated.
func connectPrivilege(ce *pgconn.ConnectError, pe *pgconn.PgError) (Privilege, bool) {
	if !strings.Contains(pe.Detail, "CONNECT") && !strings.Contains(pe.Message, "permission denied for database") {
		return Privilege{}, false
	}
	db := ""
	if ce.Config != nil {
		// Without a database, PostgreSQL connects to the one named like
		// the user.
		db = ce.Config.Database
		if db == "" {
			db = ce.Config.User
		}
	}
	if db == "" {
		return Privilege{}, false
	}
	return ConnectPrivilege(db), true
}

// ReadAllStats is the predefined role without which a standby's
// pg_stat_wal_receiver hides received_tli (Replica.Timeline 0 while
// ReceiverRunning).
var ReadAllStats = Privilege{Role: "pg_read_all_stats", Need: Required,
	Lost: "pg_stat_wal_receiver hides received_tli: every replica's epoch is unknown and caughtup never uses it"}
