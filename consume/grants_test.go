package consume

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// poolsAs returns a function opening a pool on a node's port, as role, to
// e's database.
func (e *env) poolsAs(t *testing.T, role string) func(port int) *pgxpool.Pool {
	return func(port int) *pgxpool.Pool {
		p, err := pgxpool.New(ctxT(t), fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", role, port, url.PathEscape(e.db)))
		require.NoError(t, err)
		t.Cleanup(p.Close)
		return p
	}
}

// replicasAs names c's replicas r1, r2, … with the pools as opens.
func replicasAs(c *pgtest.Cluster, as func(port int) *pgxpool.Pool) []replay.Replica {
	var reps []replay.Replica
	for i, n := range c.Replicas() {
		reps = append(reps, replay.Replica{Name: fmt.Sprintf("r%d", i+1), Pool: as(n.Port())})
	}
	return reps
}

// waitUngranted waits until every replica of "main" is unknown for a
// missing grant.
func waitUngranted(t *testing.T, r *Router, what string) *replay.Snapshot {
	t.Helper()
	return waitUntil(t, r, what, func(s *replay.Snapshot) bool {
		for _, rs := range s.Database("main").Replicas {
			if !errors.Is(rs.Err, replay.ErrMissingGrant) {
				return false
			}
		}
		return true
	})
}

// TestMissingGrant: a tracker role without pg_read_all_stats cannot see a
// standby's timeline, so no replica can be used. That is its own reason,
// in decisions and in the Snapshot, with the GRANT to run, logged once;
// once granted, the replicas serve jobs.
func TestMissingGrant(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	e := setup(t, c)
	ctx := ctxT(t)
	role := fmt.Sprintf("tracker_%d", time.Now().UnixNano()%1e9)
	_, err := e.primary.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN", role))
	require.NoError(t, err)
	_, err = e.primary.Exec(ctx, fmt.Sprintf("GRANT SELECT ON items TO %s", role))
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	as := e.poolsAs(t, role)
	reps := replicasAs(c, as)
	logs := &captured{}
	r := e.router(t, func(cfg *Config) {
		cfg.Databases = map[string]replay.Database{"main": {Primary: as(c.Primary().Port()), Replicas: reps}}
		cfg.Logger = slog.New(logs)
		cfg.WaitBudget = -1
	})
	_, tok := e.write(t)
	s := waitUngranted(t, r, "the replicas are unknown for the grant")
	var ge *replay.GrantError
	require.ErrorAs(t, s.Database("main").Replicas[0].Err, &ge)
	require.Equal(t, fmt.Sprintf(`GRANT pg_read_all_stats TO "%s";`, role), strings.TrimSpace(ge.Grant))
	_, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, ReasonMissingGrant, d.Reason)
	require.Equal(t, OutcomePrimary, d.Outcome)
	time.Sleep(300 * time.Millisecond) // more polls, no more warnings
	warned := logs.lines("caughtup: the tracker's role lacks a privilege")
	require.Len(t, warned, len(reps), "one warning per replica: %v", warned)

	_, err = e.primary.Exec(ctx, ge.Grant)
	require.NoError(t, err)
	seen(t, r, tok)
	_, d, err = r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomeReplica, d.Outcome, "granted, the replicas serve jobs")
}

// TestMissingConnectGrant: replica pools whose role may not CONNECT to the
// database are refused before any query ("permission denied for database",
// SQLSTATE 42501 at connect time). That is a missing grant like the
// others: decisions say missing_grant, not no_healthy_replica, the
// Snapshot names CONNECT and the GRANT that fixes it, logged once per
// node; once granted, the replicas serve jobs. The primary pool's role,
// refused the same way, is named too.
func TestMissingConnectGrant(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	e := setup(t, c)
	ctx := ctxT(t)
	role := fmt.Sprintf("noconnect_%d", time.Now().UnixNano()%1e9)
	for _, sql := range []string{
		"CREATE ROLE " + role + " LOGIN IN ROLE pg_read_all_stats",
		"GRANT SELECT ON items TO " + role,
		"REVOKE CONNECT ON DATABASE " + pgx.Identifier{e.db}.Sanitize() + " FROM PUBLIC",
	} {
		_, err := e.primary.Exec(ctx, sql)
		require.NoError(t, err)
	}
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	as := e.poolsAs(t, role)
	reps := replicasAs(c, as)
	logs := &captured{}
	r := e.router(t, func(cfg *Config) {
		cfg.Databases = map[string]replay.Database{"main": {Primary: e.primary, Replicas: reps}}
		cfg.Logger = slog.New(logs)
		cfg.WaitBudget = -1
	})
	_, tok := e.write(t)
	s := waitUngranted(t, r, "the replicas are unknown for the CONNECT grant")
	want := fmt.Sprintf(`GRANT CONNECT ON DATABASE "%s" TO "%s";`, e.db, role)
	for _, rs := range s.Database("main").Replicas {
		var ge *replay.GrantError
		require.ErrorAs(t, rs.Err, &ge, rs.Name)
		require.Equal(t, role, ge.Role)
		require.Equal(t, "CONNECT on database "+e.db, ge.Privilege)
		require.Equal(t, want, ge.Grant)
		var ce *pgconn.ConnectError
		require.ErrorAs(t, rs.Err, &ce, "the connection's error, unwrapped")
		require.Contains(t, rs.Err.Error(), want)
	}
	for range 3 {
		_, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, OutcomePrimary, d.Outcome)
		require.Equal(t, ReasonMissingGrant, d.Reason)
	}
	time.Sleep(300 * time.Millisecond) // more polls, no more warnings
	warned := logs.lines("caughtup: the tracker's role lacks a privilege")
	require.Len(t, warned, len(reps), "one warning per replica: %v", warned)
	for _, w := range warned {
		require.Equal(t, want, w["caughtup.grant"])
	}

	// The primary pool's role, refused the same way: its state names the
	// grant too.
	pr := e.router(t, func(cfg *Config) {
		cfg.Databases = map[string]replay.Database{"main": {Primary: as(c.Primary().Port()), Replicas: reps}}
		cfg.Logger = slog.New(&captured{})
		cfg.WaitBudget = -1
	})
	ps := waitUntil(t, pr, "the primary is unknown for the CONNECT grant", func(s *replay.Snapshot) bool {
		return errors.Is(s.Database("main").Primary.Err, replay.ErrMissingGrant)
	})
	var ge *replay.GrantError
	require.ErrorAs(t, ps.Database("main").Primary.Err, &ge)
	require.Equal(t, want, ge.Grant)

	_, err := e.primary.Exec(ctx, want)
	require.NoError(t, err)
	seen(t, r, tok)
	_, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomeReplica, d.Outcome, "granted, the replicas serve jobs")
}
