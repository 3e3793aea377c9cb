package pgtest_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

// PromoteAlone leaves the old primary running and its other replicas
// following it: writes made there after the promotion reach those replicas
// (which then hold WAL the new primary lacks) but not the new primary.
// Follow brings such a replica back, rebuilt.
func TestPromoteAlone(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := ownCluster(ctx, t, 2)
	old, r1, r2 := c.Primary(), c.Replicas()[0], c.Replicas()[1]
	require.NoError(t, old.Exec(ctx, "", "CREATE TABLE t (id int); INSERT INTO t VALUES (1)"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))

	got, err := c.PromoteAlone(ctx, r1)
	require.NoError(t, err)
	require.Same(t, old, got)
	require.Same(t, r1, c.Primary())
	require.Equal(t, []*pgtest.Node{r2}, c.Replicas())
	require.True(t, old.Running(), "the old primary keeps running")
	require.EqualValues(t, 2, timeline(ctx, t, r1))

	// The old primary still takes writes, and r2 still replays them.
	require.NoError(t, old.Exec(ctx, "", "INSERT INTO t VALUES (2)"))
	at, err := old.ReplayLSN(ctx)
	require.NoError(t, err)
	require.NoError(t, r2.WaitReplay(ctx, at))
	require.EqualValues(t, 1, timeline(ctx, t, r2), "r2 is still on the old timeline")
	require.Equal(t, 2, rowsInT(ctx, t, r2), "r2 has the row written on the old primary after the promotion")
	require.Equal(t, 1, rowsInT(ctx, t, r1), "the new primary never had it")

	// Follow rebuilds the diverged replica from the new primary.
	require.NoError(t, r2.Follow(ctx, r1))
	require.NoError(t, r1.Exec(ctx, "", "INSERT INTO t VALUES (3)"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	require.EqualValues(t, 2, timeline(ctx, t, r2))
	require.Equal(t, 2, rowsInT(ctx, t, r2), "rows 1 and 3: the old primary's row 2 is gone")
	require.Error(t, r2.Follow(ctx, old), "only the current primary can be followed")
}

// SetConf and StartAccepting restart a replica held back by
// recovery_min_apply_delay: it accepts connections without streaming, and
// replays on once the delay is lifted.
func TestSetConfStartAccepting(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c := ownCluster(ctx, t, 1)
	p, r := c.Primary(), c.Replicas()[0]
	require.NoError(t, p.Exec(ctx, "", "CREATE TABLE t (id int)"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	// A restartpoint, so that the restarted replica is consistent past the
	// CREATE TABLE: without it, it may accept connections before it (at
	// its minimum recovery point) and stop there at the delayed commit.
	require.NoError(t, r.Exec(ctx, "", "CHECKPOINT"))

	require.NoError(t, r.Kill())
	require.NoError(t, r.SetConf(ctx, map[string]string{"recovery_min_apply_delay": "'1h'"}))
	require.NoError(t, p.Exec(ctx, "", "INSERT INTO t VALUES (1)"))
	require.NoError(t, r.StartAccepting(ctx))
	require.True(t, r.Running())
	pool, err := r.Pool(ctx, "")
	require.NoError(t, err)
	defer pool.Close()
	require.Equal(t, 0, count(ctx, t, pool, "SELECT count(*) FROM t"), "the delayed commit is not replayed")

	require.NoError(t, r.SetConf(ctx, map[string]string{"recovery_min_apply_delay": ""}))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	require.Equal(t, 1, count(ctx, t, pool, "SELECT count(*) FROM t"))
}
