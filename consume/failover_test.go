package consume

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// privateCluster is for tests that kill or promote nodes.
func privateCluster(t *testing.T) *pgtest.Cluster {
	t.Helper()
	c, err := pgtest.Start(ctxT(t), pgtest.Options{Replicas: 2, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

func TestKilledReplicaIsExcluded(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	e := setup(t, c)
	const poll, bound = 50 * time.Millisecond, 300 * time.Millisecond
	r := e.router(t, func(c *Config) { c.Tracker.StalenessBound = bound })
	_, tok := e.write(t)
	seen(t, r, tok)
	ctx := ctxT(t)

	used := map[string]int{}
	for range 10 {
		_, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
		require.NoError(t, err)
		used[d.Databases[0].Replica]++
	}
	require.Equal(t, map[string]int{"r1": 5, "r2": 5}, used, "caught-up replicas share the load")

	killed := time.Now()
	require.NoError(t, c.Replicas()[1].Kill())
	// Excluded once its query fails or its last observation is older
	// than the bound; either publishes a snapshot (a failed query) or
	// is seen at the next one the other nodes' polls publish.
	waitUntil(t, r, "the killed replica is excluded", func(s *replay.Snapshot) bool {
		return !s.Database("main").Replicas[1].Usable(time.Now().Add(-bound))
	})
	t.Logf("killed replica excluded %v after the kill (expected within one interval %v + staleness %v)", time.Since(killed), poll, bound)
	for range 10 {
		_, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, "r1", d.Databases[0].Replica)
	}

	// With the last replica paused too, nothing is caught up: sticky reads
	// the primary, never the dead replica.
	require.NoError(t, c.Replicas()[0].PauseReplay(ctx))
	_, tok2 := e.write(t)
	_, d, err := r.Route(ctx, Job{Token: tok2, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimary, d.Outcome)
	require.Equal(t, ReasonReplicaBehind, d.Reason)
	require.NoError(t, c.Replicas()[0].ResumeReplay(ctx))
}

// multiHost is a pool that follows the primary across a failover, as an
// application's primary pool would (through DNS, a proxy or libpq's
// target_session_attrs).
func multiHost(t *testing.T, c *pgtest.Cluster, db string) *pgxpool.Pool {
	hosts := make([]string, 0, 3)
	for _, n := range c.Nodes() {
		hosts = append(hosts, fmt.Sprintf("127.0.0.1:%d", n.Port()))
	}
	dsn := fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
		strings.Join(hosts, ","), db)
	p, err := pgxpool.New(ctxT(t), dsn)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

func TestPromotedReplicaIsExcluded(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	e := setup(t, c)
	e.primary = multiHost(t, c, e.db)
	r := e.router(t)
	ctx := ctxT(t)

	id, before := e.write(t)
	seen(t, r, before)
	sys := before.Entries[0].Epoch.SystemID
	require.Equal(t, uint32(1), before.Entries[0].Epoch.Timeline)

	require.NoError(t, c.Promote(ctx, c.Replicas()[0]))

	// The tracker sees the new epoch with its history, the promoted node
	// out of recovery, and the other replica following timeline 2.
	ds := waitUntil(t, r, "the tracker sees the promotion", func(s *replay.Snapshot) bool {
		ds := s.Database("main")
		return ds.Primary.Err == nil && ds.Primary.Epoch == position.Epoch{SystemID: sys, Timeline: 2} &&
			ds.Primary.HistoryKnown &&
			ds.Replicas[0].Err == nil && !ds.Replicas[0].InRecovery &&
			ds.Replicas[1].Err == nil && ds.Replicas[1].Replayed.Epoch.Timeline == 2
	}).Database("main")
	sp, ok := ds.Primary.History.Switchpoint(1)
	require.True(t, ok, "history %v", ds.Primary.History)
	require.GreaterOrEqual(t, sp, before.Entries[0].LSN)
	t.Logf("timeline 1 ended at %v; history %v", sp, ds.Primary.History)

	// A timeline-1 token within the shared history reads the replica
	// that follows timeline 2, never the promoted node.
	for range 6 {
		hctx, d, err := r.Route(ctx, Job{Token: before, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, OutcomeReplica, d.Outcome, "%+v", d)
		require.Equal(t, "r2", d.Databases[0].Replica)
		require.True(t, found(t, DB(hctx, "main"), id))
	}

	// New writes carry timeline 2 and read the following replica once it
	// has them. (The application's pool drops its connections to the old
	// primary first.)
	e.primary.Reset()
	id2, after := e.write(t)
	require.Equal(t, uint32(2), after.Entries[0].Epoch.Timeline)
	hctx, d, err := r.Route(ctx, Job{Token: after, Policy: Delayed})
	require.NoError(t, err)
	require.Contains(t, []Outcome{OutcomeReplica, OutcomeReplicaWaited}, d.Outcome)
	require.Equal(t, "r2", d.Databases[0].Replica)
	require.True(t, found(t, DB(hctx, "main"), id2))

	// A timeline-1 position past the switchpoint names WAL the new
	// history does not have (a write lost in the failover): the primary,
	// although numerically the replica has replayed that far.
	replayed := r.Snapshot().Database("main").Replicas[1].Replayed.LSN
	require.Greater(t, replayed, sp, "the new timeline has records past the switchpoint")
	lost := position.New("main", position.Epoch{SystemID: sys, Timeline: 1}, replayed, position.SourcePrimary, time.Now())
	hctx, d, err = r.Route(ctx, Job{Token: lost, Policy: Delayed})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimaryEpoch, d.Outcome)
	require.Equal(t, position.PastSwitchpoint, d.Databases[0].Incomparable)
	require.Same(t, e.primary, DB(hctx, "main"))
}

// TestTokenAheadOfRoutersPrimary: after a promotion behind the router's
// back (its primary pool still reaches the old primary, which keeps
// running), tokens of the new primary's writes are on a timeline the
// router's primary does not have. They never read that old primary (it
// lacks their writes), nor the standby still following it: Sticky jobs are
// refused (ErrPrimaryBehind), Delayed ones wait and are deferred.
func TestTokenAheadOfRoutersPrimary(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	e := setup(t, c)
	r := e.router(t, func(c *Config) { c.WaitBudget = 20 * time.Millisecond })
	ctx := ctxT(t)
	_, before := e.write(t)
	seen(t, r, before)

	_, err := c.PromoteAlone(ctx, c.Replicas()[0]) // the old primary keeps running: the router's primary pool stays on it
	require.NoError(t, err)
	onNew := e.replicas[0] // now the new primary's pool
	waitUntil(t, r, "the tracker sees r1 promoted", func(s *replay.Snapshot) bool {
		rs := s.Database("main").Replicas[0]
		return rs.Observations > 0 && !rs.InRecovery
	})

	require.Never(t, func() bool { return r.Snapshot().Database("main").Primary.Epoch.Timeline != 1 }, 300*time.Millisecond, 10*time.Millisecond,
		"the router's primary is the old one")
	for i := range 40 {
		var id int64
		require.NoError(t, onNew.QueryRow(ctx, "INSERT INTO items (v) VALUES ('new') RETURNING id").Scan(&id))
		tok := capture(t, onNew, "main")
		require.Equal(t, uint32(2), tok.Entries[0].Epoch.Timeline)
		policy := Sticky
		if i%2 == 1 {
			policy = Delayed
		}
		hctx, d, err := r.Route(ctx, Job{Token: tok, Policy: policy})
		if err == nil {
			// Only a node that has the write may serve it.
			require.True(t, found(t, DB(hctx, "main"), id), "decided %s/%s and missed the write", d.Outcome, d.Reason)
			continue
		}
		require.ErrorIs(t, err, ErrDeferred)
		require.Equal(t, ReasonPrimaryBehind, d.Databases[0].Reason, "%s", policy)
		if policy == Sticky {
			require.ErrorIs(t, err, ErrPrimaryBehind)
		} else {
			require.Equal(t, ActionDefer, d.Action)
		}
	}
}
