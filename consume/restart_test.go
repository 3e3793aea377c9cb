package consume

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// readRow is a handler's read: whether the row is there, or the error.
func readRow(ctx context.Context, pool *pgxpool.Pool, id int64) (bool, error) {
	var n int
	err := pool.QueryRow(ctx, "SELECT count(*) FROM items WHERE id = $1", id).Scan(&n)
	return n == 1, err
}

// The restart window, on the real cluster: a job is routed to a replica
// that has replayed its row; the replica then crashes and comes back
// showing less than it had replayed (held below the row by
// recovery_min_apply_delay, as a slow or stuck replay would); the handler
// reads after that. A read on the application's own pool then is stale,
// with no error. Through the pool the router hands out it never is: the
// new connection is of a new run of the server, so it is checked, and
// refused until the replica has replayed the job's token. The tracker,
// meanwhile, sees the restart and routes no new job to the replica until
// it passes its old position.
func TestReplicaRestartWindow(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	c := privateCluster(t)
	e := setup(t, c)
	node := c.Replicas()[0]
	plain := e.replicas[0]
	// A restartpoint, so that the restarted replica still has the table.
	require.NoError(t, node.Exec(ctx, "", "CHECKPOINT"))

	r := e.router(t, func(cfg *Config) {
		cfg.Databases = map[string]replay.Database{"main": {Primary: e.primary, Replicas: []replay.Replica{{Name: "r1", Pool: plain}}}}
	})
	_, err := readRow(ctx, plain, 0) // a connection opened before the restart
	require.NoError(t, err)

	id, tok := e.write(t)
	seen(t, r, tok)
	h, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, "r1", d.Databases[0].Replica)
	_, err = readRow(h, DB(h, "main"), id) // the handler pool's connection, before the restart
	require.NoError(t, err)

	// Between the decision and the reads: a crash, and a restart that
	// stops short of the row.
	require.NoError(t, node.Kill())
	require.NoError(t, node.SetConf(ctx, map[string]string{"recovery_min_apply_delay": "'1h'"}))
	require.NoError(t, node.StartAccepting(ctx))
	t.Cleanup(func() { _ = node.SetConf(context.Background(), map[string]string{"recovery_min_apply_delay": ""}) })
	at, err := node.ReplayLSN(ctx)
	require.NoError(t, err)
	require.Less(t, position.MustParseLSN(at), tok.Entries[0].LSN,
		"precondition: the restarted replica must show less than it had replayed (it is at %s)", at)

	// Each read is a handler's attempt; a failed one is retried, as a
	// queue would.
	attempt := func(h context.Context, pool *pgxpool.Pool) (stale, failed int, last error) {
		for range 5 {
			ok, err := readRow(h, pool, id)
			switch {
			case err != nil:
				failed++
				last = err
			case !ok:
				stale++
			default:
				return
			}
		}
		return
	}
	stale, _, _ := attempt(context.Background(), plain)
	require.Positive(t, stale, "a read on the application's pool after the restart is stale: the window is real")
	stale, failed, last := attempt(h, DB(h, "main"))
	require.Zero(t, stale, "no stale read through the router's pool")
	require.Positive(t, failed)
	require.ErrorIs(t, last, ErrReplicaBehind)

	// The tracker saw the restart: the replica is held (or its epoch
	// unknown until its WAL receiver runs); no new decision uses it.
	require.Eventually(t, func() bool {
		rs := r.Snapshot().Database("main").Replicas[0]
		return rs.Restarts == 1 && rs.Err == nil && rs.RestartFloor >= tok.Entries[0].LSN
	}, 30*time.Second, 10*time.Millisecond)
	_, d, err = r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimary, d.Outcome, "%+v", d)

	// Replay resumes: the connections are admitted, the hold ends, the row
	// is read from the replica.
	require.NoError(t, node.SetConf(ctx, map[string]string{"recovery_min_apply_delay": ""}))
	require.Eventually(t, func() bool {
		ok, err := readRow(h, DB(h, "main"), id)
		if err != nil && !errors.Is(err, ErrReplicaBehind) {
			t.Logf("read: %v", err)
		}
		return err == nil && ok
	}, 30*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool {
		rs := r.Snapshot().Database("main").Replicas[0]
		return rs.RestartFloor == 0 && rs.Usable(time.Now().Add(-time.Second))
	}, 30*time.Second, 10*time.Millisecond)
	_, d, err = r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, "r1", d.Databases[0].Replica)
}
