package pgwal_test

import (
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

func TestReadIdentity(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx := ctxT(t)
	sys, err := c.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)

	p, err := pgwal.ReadIdentity(ctx, connect(t, c.Primary().DSN("")))
	require.NoError(t, err)
	require.False(t, p.InRecovery)
	require.True(t, p.SystemIDKnown)
	require.Equal(t, sys, p.SystemID)
	require.Equal(t, "127.0.0.1", p.Addr, "host() drops the /32")
	require.Equal(t, c.Primary().Port(), p.Port)
	require.False(t, p.PostmasterStart.IsZero())
	require.GreaterOrEqual(t, p.ServerVersion, 150000)
	require.Zero(t, p.Receiver, "a primary has no WAL receiver")

	r := c.Replicas()[0]
	id, err := pgwal.ReadIdentity(ctx, connect(t, r.DSN("")))
	require.NoError(t, err)
	require.True(t, id.InRecovery)
	require.Equal(t, sys, id.SystemID)
	require.Equal(t, r.Port(), id.Port)
	require.Equal(t, pgwal.Receiver{Running: true, Status: "streaming", SenderHost: "127.0.0.1", SenderPort: c.Primary().Port()}, id.Receiver)

	again, err := pgwal.ReadIdentity(ctx, connect(t, r.DSN("")))
	require.NoError(t, err)
	require.True(t, id.Same(again), "two connections to one server")
	require.False(t, id.Same(p), "a standby and its primary share the system identifier, not the server")
	require.Contains(t, id.Server(), fmt.Sprintf("127.0.0.1:%d (system %d, up since ", r.Port(), sys))
}

func TestReadClockAndSettings(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx := ctxT(t)
	conn := connect(t, c.Primary().DSN(""))
	var want int64
	require.NoError(t, conn.QueryRow(ctx, "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8").Scan(&want))
	got, err := pgwal.ReadClock(ctx, conn)
	require.NoError(t, err)
	require.GreaterOrEqual(t, got.UnixMicro(), want, "the server's clock, read after it")
	require.Less(t, got.UnixMicro()-want, int64(5_000_000))

	s, err := pgwal.ReadSettings(ctx, conn, "hot_standby_feedback", "max_standby_streaming_delay", "synchronous_commit")
	require.NoError(t, err)
	require.Equal(t, map[string]string{"hot_standby_feedback": "off", "max_standby_streaming_delay": "30s", "synchronous_commit": "on"}, s,
		"pgtest's settings, as SHOW prints them")
	_, err = pgwal.ReadSettings(ctx, conn, "no_such_setting")
	require.Error(t, err)
}

// names lists the names of privileges.
func names(ps []pgwal.Privilege) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.Name()
	}
	return out
}

// TestRightsAndGrants: on a hardened cluster (the control functions
// revoked from PUBLIC), a plain role lacks exactly those, pg_read_all_stats
// and pg_read_file; the reads fail or hide the timeline as Privileges
// says; after the GrantSQL statements every read works and nothing is
// missing. The cluster is the test's own: the REVOKE is cluster-wide.
func TestRightsAndGrants(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	p, r := c.Primary(), c.Replicas()[0]
	require.NoError(t, p.Exec(ctx, "", "REVOKE EXECUTE ON FUNCTION pg_control_system(), pg_control_init() FROM PUBLIC"))
	require.NoError(t, p.Exec(ctx, "", `CREATE ROLE "Plain" LOGIN`))
	require.NoError(t, p.Exec(ctx, "", "CREATE ROLE noinherit LOGIN NOINHERIT IN ROLE pg_monitor"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	as := func(role string, n *pgtest.Node) *pgx.Conn {
		return connect(t, fmt.Sprintf("postgres://%s@127.0.0.1:%d/postgres?sslmode=disable", role, n.Port()))
	}

	su, err := pgwal.ReadRights(ctx, connect(t, p.DSN("")))
	require.NoError(t, err)
	require.Equal(t, pgwal.RoleRights{Role: "postgres", Superuser: true}, su)

	for _, n := range []*pgtest.Node{p, r} {
		rights, err := pgwal.ReadRights(ctx, as("Plain", n))
		require.NoError(t, err)
		require.Equal(t, "Plain", rights.Role)
		require.False(t, rights.Superuser)
		require.Equal(t, []string{"EXECUTE on pg_control_system()", "EXECUTE on pg_control_init()", "pg_read_all_stats"}, names(rights.MissingAt(pgwal.Required)), n.Name())
		require.Equal(t, []string{"EXECUTE on pg_read_file(text)"}, names(rights.MissingAt(pgwal.Degraded)), n.Name())
		require.Empty(t, rights.NoInherit)
	}
	noinh, err := pgwal.ReadRights(ctx, as("noinherit", r))
	require.NoError(t, err)
	require.Equal(t, []string{"pg_read_all_stats"}, noinh.NoInherit, "a member of pg_monitor that does not inherit its privileges")

	plainReplica := as("Plain", r)
	_, err = pgwal.ReadReplica(ctx, plainReplica, pgwal.Control)
	require.ErrorContains(t, err, "permission denied for function pg_control_system")
	id, err := pgwal.ReadIdentity(ctx, plainReplica)
	require.NoError(t, err, "ReadIdentity asks for the system identifier only when the role may")
	require.False(t, id.SystemIDKnown)
	require.Equal(t, pgwal.Receiver{Running: true}, id.Receiver, "only the pid is visible")
	_, err = pgwal.ReadHistory(ctx, as("Plain", p), 2)
	require.ErrorIs(t, err, pgwal.ErrHistoryDenied)

	for _, priv := range pgwal.Privileges {
		require.NoError(t, p.Exec(ctx, "", priv.GrantSQL("Plain")))
	}
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	for _, n := range []*pgtest.Node{p, r} {
		rights, err := pgwal.ReadRights(ctx, as("Plain", n))
		require.NoError(t, err)
		require.Empty(t, rights.Missing, n.Name())
	}
	_, err = pgwal.ReadPrimary(ctx, as("Plain", p), pgwal.Control)
	require.NoError(t, err)
	rr, err := pgwal.ReadReplica(ctx, as("Plain", r), pgwal.Control|pgwal.Status)
	require.NoError(t, err)
	require.NotZero(t, rr.Timeline)
	require.NotZero(t, rr.Control.SystemID)
	require.False(t, rr.RecoveryStart.IsZero(), "the startup process is visible with pg_read_all_stats")
	id, err = pgwal.ReadIdentity(ctx, as("Plain", r))
	require.NoError(t, err)
	require.True(t, id.SystemIDKnown)
	require.Equal(t, "streaming", id.Receiver.Status)
	_, err = pgwal.ReadHistory(ctx, as("Plain", p), 2)
	require.Error(t, err, "no history file on timeline 1, but no longer denied")
	require.NotErrorIs(t, err, pgwal.ErrHistoryDenied)
}

func TestGrantSQLQuotesTheRole(t *testing.T) {
	t.Parallel()
	byName := map[string]pgwal.Privilege{}
	for _, p := range pgwal.Privileges {
		byName[p.Name()] = p
	}
	require.Equal(t, `GRANT EXECUTE ON FUNCTION pg_control_system() TO "a ""b""";`, byName["EXECUTE on pg_control_system()"].GrantSQL(`a "b"`))
	require.Equal(t, `GRANT pg_read_all_stats TO "app";`, byName["pg_read_all_stats"].GrantSQL("app"))
	require.Equal(t, `GRANT SELECT ON pg_stat_wal_receiver TO "app";`, byName["SELECT on pg_stat_wal_receiver"].GrantSQL("app"))
}

// TestConnectPrivilege: a role without CONNECT on a database is refused
// when it connects, before any query, on the primary and on a standby
// alike (the REVOKE replicates). MissingPrivilege names CONNECT on that
// database, and its GrantSQL lets the role in. A database of the test's
// own keeps the shared cluster's others untouched.
func TestConnectPrivilege(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx := ctxT(t)
	db := fmt.Sprintf("Revoked %d", time.Now().UnixNano()%1e9)
	role := fmt.Sprintf("noconnect_%d", time.Now().UnixNano()%1e9)
	require.NoError(t, c.CreateDatabase(ctx, db))
	su := connect(t, c.Primary().DSN(""))
	for _, sql := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"REVOKE CONNECT ON DATABASE " + pgx.Identifier{db}.Sanitize() + " FROM PUBLIC",
	} {
		_, err := su.Exec(ctx, sql)
		require.NoError(t, err)
	}
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	dsn := func(n *pgtest.Node) string {
		return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", role, n.Port(), url.PathEscape(db))
	}
	var grant string
	for _, n := range c.Nodes() {
		_, err := pgx.Connect(ctx, dsn(n))
		var ce *pgconn.ConnectError
		require.ErrorAs(t, err, &ce, n.Name())
		p, ok := pgwal.MissingPrivilege(err)
		require.True(t, ok, "%s: %v", n.Name(), err)
		require.Equal(t, pgwal.Required, p.Need)
		require.Equal(t, "CONNECT on database "+db, p.Name())
		require.NotEmpty(t, p.Lost)
		grant = p.GrantSQL(role)
		require.Equal(t, fmt.Sprintf(`GRANT CONNECT ON DATABASE "%s" TO "%s";`, db, role), grant)
	}
	_, ok := pgwal.MissingPrivilege(fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "42501", Message: "permission denied for function pg_ls_dir"}))
	require.False(t, ok, "a query's 42501 naming nothing caughtup calls")
	_, err := pgx.Connect(ctx, fmt.Sprintf("postgres://nosuchrole_%d@127.0.0.1:%d/postgres?sslmode=disable", time.Now().UnixNano()%1e9, c.Primary().Port()))
	require.Error(t, err)
	_, ok = pgwal.MissingPrivilege(err)
	require.False(t, ok, "an unknown role (28000) is not a missing grant: %v", err)

	_, err = su.Exec(ctx, grant)
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	for _, n := range c.Nodes() {
		conn := connect(t, dsn(n))
		rights, err := pgwal.ReadRights(ctx, conn)
		require.NoError(t, err, n.Name())
		require.Equal(t, role, rights.Role)
	}
}
