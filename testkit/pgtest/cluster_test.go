package pgtest_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

func count(ctx context.Context, t *testing.T, pool *pgxpool.Pool, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(ctx, sql).Scan(&n))
	return n
}

// rowsInT counts the rows of table t on node n, in database postgres.
func rowsInT(ctx context.Context, t *testing.T, n *pgtest.Node) int {
	t.Helper()
	p, err := n.Pool(ctx, "")
	require.NoError(t, err)
	defer p.Close()
	return count(ctx, t, p, "SELECT count(*) FROM t")
}

func timeline(ctx context.Context, t *testing.T, n *pgtest.Node) uint32 {
	t.Helper()
	tli, err := n.Timeline(ctx)
	require.NoError(t, err)
	return tli
}

func pools(ctx context.Context, t *testing.T, nodes []*pgtest.Node, db string) []*pgxpool.Pool {
	t.Helper()
	var ps []*pgxpool.Pool
	for _, n := range nodes {
		p, err := n.Pool(ctx, db)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		ps = append(ps, p)
	}
	return ps
}

func TestSharedClusterReplicates(t *testing.T) {
	began := time.Now()
	c, db, ctx := setup(t)
	t.Logf("shared cluster (first use starts it) + database ready in %v", time.Since(began).Round(time.Millisecond))

	require.Len(t, c.Replicas(), 2)
	require.Len(t, c.Nodes(), 3)
	require.Equal(t, "primary", c.Primary().Name())
	require.Equal(t, []string{"replica1", "replica2"}, []string{c.Replicas()[0].Name(), c.Replicas()[1].Name()})

	primary, err := c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	t.Cleanup(primary.Close)
	_, err = primary.Exec(ctx, "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 100)")
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))

	sysid, err := c.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)
	for i, p := range pools(ctx, t, c.Replicas(), db) {
		r := c.Replicas()[i]
		require.Equal(t, 100, count(ctx, t, p, "SELECT count(*) FROM t"), r.Name())
		rec, err := r.InRecovery(ctx)
		require.NoError(t, err)
		require.True(t, rec)
		id, err := r.SystemIdentifier(ctx)
		require.NoError(t, err)
		require.Equal(t, sysid, id)
		tli, err := r.Timeline(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 1, tli)
	}
	tli, err := c.Primary().Timeline(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 1, tli)
	require.Contains(t, c.Primary().DSN(""), "/postgres?sslmode=disable")
}

func TestPauseReplayHidesNewRows(t *testing.T) {
	c, db, ctx := setup(t)
	r1, r2 := c.Replicas()[0], c.Replicas()[1]
	ps := pools(ctx, t, []*pgtest.Node{c.Primary(), r1}, db)
	primary, replica := ps[0], ps[1]
	_, err := primary.Exec(ctx, "CREATE TABLE t (id int)")
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))

	require.NoError(t, r1.PauseReplay(ctx))
	t.Cleanup(func() { _ = r1.ResumeReplay(context.Background()) })
	_, err = primary.Exec(ctx, "INSERT INTO t VALUES (1)")
	require.NoError(t, err)
	target, err := c.Primary().ReplayLSN(ctx)
	require.NoError(t, err)
	require.NoError(t, r2.WaitReplay(ctx, target), "the other replica is not paused")

	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	require.Error(t, r1.WaitReplay(short, target))
	require.Equal(t, 0, count(ctx, t, replica, "SELECT count(*) FROM t"))

	require.NoError(t, r1.ResumeReplay(ctx))
	require.NoError(t, r1.WaitReplay(ctx, target))
	require.Equal(t, 1, count(ctx, t, replica, "SELECT count(*) FROM t"))
}

// givingUp is a connection whose caller gives up while its statement is
// on its way to the server, as on a loaded machine: it ends the caller's
// context, then sends the statement with it.
type givingUp struct {
	pgtest.Execer
	cancel context.CancelFunc
}

func (g givingUp) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	g.cancel()
	return g.Execer.Exec(ctx, sql, args...)
}

// TestRequestReplayPauseOutlivesItsContext: a pause request is either
// never sent (its context had ended) or answered before it returns, so
// that a resume after it is the last word on the replica.
func TestRequestReplayPauseOutlivesItsContext(t *testing.T) {
	c, db, ctx := setup(t)
	r1 := c.Replicas()[0]
	replica := pools(ctx, t, []*pgtest.Node{r1}, db)[0]
	t.Cleanup(func() { _ = r1.ResumeReplay(context.Background()) })
	state := func() string {
		var s string
		require.NoError(t, replica.QueryRow(ctx, "SELECT pg_get_wal_replay_pause_state()").Scan(&s))
		return s
	}

	ended, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, pgtest.RequestReplayPause(ended, replica), context.Canceled)
	require.Equal(t, "not paused", state(), "a context already ended sends nothing")

	mid, cancel := context.WithCancel(ctx)
	defer cancel()
	require.NoError(t, pgtest.RequestReplayPause(mid, givingUp{replica, cancel}))
	require.Error(t, mid.Err())
	require.NotEqual(t, "not paused", state(), "the request was answered before it returned")
	require.NoError(t, r1.ResumeReplay(ctx))
	require.Equal(t, "not paused", state(), "the resume after it is the last word")
}

// Stops and kills a replica of the shared cluster; it restores it, and runs
// serially, so the other tests of this package never see it down.
func TestReplicaStopKillStart(t *testing.T) {
	c, db, ctx := setup(t)
	r := c.Replicas()[1]
	primary := pools(ctx, t, []*pgtest.Node{c.Primary()}, db)[0]
	_, err := primary.Exec(ctx, "CREATE TABLE t (id int)")
	require.NoError(t, err)
	port := r.Port()

	for _, stop := range []struct {
		name string
		do   func() error
	}{
		{"Stop", func() error { return r.Stop(ctx) }},
		{"Kill", r.Kill},
	} {
		require.NoError(t, stop.do(), stop.name)
		require.False(t, r.Running(), stop.name)
		// The port stays reserved but refuses connections, like a dead server.
		_, err := pgx.Connect(ctx, r.DSN(""))
		require.ErrorContains(t, err, "refused")
		_, err = primary.Exec(ctx, "INSERT INTO t VALUES (1)")
		require.NoError(t, err)
		require.NoError(t, c.WaitReplicasCaughtUp(ctx), "stopped replicas are skipped")

		require.NoError(t, r.Start(ctx), stop.name)
		require.True(t, r.Running())
		require.Equal(t, port, r.Port())
		require.NoError(t, c.WaitReplicasCaughtUp(ctx))
		p, err := r.Pool(ctx, db)
		require.NoError(t, err)
		n := count(ctx, t, p, "SELECT count(*) FROM t")
		p.Close()
		require.Equal(t, map[string]int{"Stop": 1, "Kill": 2}[stop.name], n, "rows after %s/Start", stop.name)
	}
}

func TestHoldQueryStallsReplay(t *testing.T) {
	c, db, ctx := setup(t)
	r1, r2 := c.Replicas()[0], c.Replicas()[1]
	primary := pools(ctx, t, []*pgtest.Node{c.Primary()}, db)[0]
	_, err := primary.Exec(ctx, "CREATE TABLE t (id int); INSERT INTO t SELECT generate_series(1, 1000)")
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))

	release, err := r1.HoldQuery(ctx, db, 20*time.Second)
	require.NoError(t, err)
	defer release()

	// Rows the held snapshot can still see are removed: replaying the
	// VACUUM would pull them from under it.
	_, err = primary.Exec(ctx, "DELETE FROM t")
	require.NoError(t, err)
	_, err = primary.Exec(ctx, "VACUUM t")
	require.NoError(t, err)
	target, err := c.Primary().ReplayLSN(ctx)
	require.NoError(t, err)
	require.NoError(t, r2.WaitReplay(ctx, target), "replica without a hold replays at once")

	short, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	require.Error(t, r1.WaitReplay(short, target), "replay should stall behind the held snapshot")

	held := time.Now()
	release()
	require.NoError(t, r1.WaitReplay(ctx, target))
	t.Logf("replay resumed %v after release", time.Since(held).Round(time.Millisecond))
}

func TestPromote(t *testing.T) {
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := ownCluster(ctx, t, 3)
	t.Logf("primary + 3 replicas started in %v", time.Since(began).Round(time.Millisecond))

	old, r1, r2, r3 := c.Primary(), c.Replicas()[0], c.Replicas()[1], c.Replicas()[2]
	sysid, err := old.SystemIdentifier(ctx)
	require.NoError(t, err)
	require.NoError(t, old.Exec(ctx, "", "CREATE TABLE t (id int); INSERT INTO t VALUES (1)"))

	// A crashed primary comes back and its replicas stream from it again.
	require.NoError(t, old.Kill())
	require.NoError(t, old.Start(ctx))
	require.NoError(t, old.Exec(ctx, "", "INSERT INTO t VALUES (2)"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))

	// replica3 is down during the failover: it is only re-pointed.
	require.NoError(t, r3.Stop(ctx))
	t0 := time.Now()
	require.NoError(t, c.Promote(ctx, r1))
	t.Logf("Promote took %v", time.Since(t0).Round(time.Millisecond))

	require.Same(t, r1, c.Primary())
	require.Equal(t, []*pgtest.Node{r2, r3}, c.Replicas())
	require.Equal(t, []*pgtest.Node{r1, r2, r3}, c.Nodes())
	require.False(t, old.Running())
	require.Error(t, old.Start(ctx), "the old primary has diverged")
	require.EqualValues(t, 2, timeline(ctx, t, r1))
	rec, err := r1.InRecovery(ctx)
	require.NoError(t, err)
	require.False(t, rec)

	require.NoError(t, r1.Exec(ctx, "", "INSERT INTO t VALUES (3)"))
	require.NoError(t, r3.Start(ctx))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	for _, r := range []*pgtest.Node{r2, r3} {
		require.EqualValues(t, 2, timeline(ctx, t, r), "%s follows the new timeline", r.Name())
		id, err := r.SystemIdentifier(ctx)
		require.NoError(t, err)
		require.Equal(t, sysid, id)
		require.Equal(t, 3, rowsInT(ctx, t, r), r.Name())
	}

	// Second failover, after a crash this time: replica3 misses a write that
	// replica2 gets, the primary dies, replica3 is promoted. replica2 is then
	// past the switchpoint and must be rebuilt from a base backup.
	require.NoError(t, r3.Stop(ctx))
	require.NoError(t, r1.Exec(ctx, "", "INSERT INTO t VALUES (4)"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	require.NoError(t, r1.Kill())
	require.NoError(t, r3.Start(ctx))
	t0 = time.Now()
	require.NoError(t, c.Promote(ctx, r3))
	t.Logf("Promote after a crash (replica2 rebuilt) took %v", time.Since(t0).Round(time.Millisecond))
	require.Equal(t, []*pgtest.Node{r3, r2}, c.Nodes())
	require.EqualValues(t, 3, timeline(ctx, t, r3))
	require.NoError(t, r3.Exec(ctx, "", "INSERT INTO t VALUES (5)"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	require.EqualValues(t, 3, timeline(ctx, t, r2))
	require.Equal(t, 4, rowsInT(ctx, t, r2), "row 4 was lost with the crashed primary; 5 arrived")

	dir := c.Dir()
	require.NoError(t, c.Close())
	require.NoError(t, c.Close(), "Close is idempotent")
	require.NoDirExists(t, dir)
	require.False(t, r1.Running() || r2.Running() || r3.Running())
}

func TestNewDatabaseNames(t *testing.T) {
	c := pgtest.Shared(t)
	a, b := pgtest.NewDatabase(t, c), pgtest.NewDatabase(t, c)
	require.NotEqual(t, a, b)
	require.True(t, strings.HasPrefix(a, "t_testnewdatabasenames_"), a)
	require.LessOrEqual(t, len(a), 63)
}
