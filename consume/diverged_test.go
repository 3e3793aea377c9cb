package consume

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// movablePool is a primary pool whose connections go to whichever port
// target holds, as an application's pool follows DNS or a proxy after a
// failover. The tracker's pool copies its config, so it follows too once
// its connection is dropped.
func movablePool(t *testing.T, c *pgtest.Cluster, db string, target *atomic.Int64) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(c.Primary().DSN(db))
	require.NoError(t, err)
	cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
		cc.Port = uint16(target.Load())
		return nil
	}
	p, err := pgxpool.NewWithConfig(ctxT(t), cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

// A failover whose old primary keeps running: r1 is promoted, r2 keeps
// following the old primary and replays writes made there after the
// promotion (past the switchpoint), r3 follows the new primary. Once the
// router's primary is the new one, r2 is diverged: no job reads it, old
// timeline or new, and no job waits on it.
func TestDivergedStandbyAfterFailover(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 3, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	e := setup(t, c)
	var target atomic.Int64
	target.Store(int64(c.Primary().Port()))
	e.primary = movablePool(t, c, e.db, &target)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := e.router(t, func(c *Config) { c.MeterProvider = mp; c.WaitBudget = 20 * time.Second })

	idA, tokA := e.write(t)
	seen(t, r, tokA)
	r1, r2, r3 := c.Replicas()[0], c.Replicas()[1], c.Replicas()[2]
	old, err := c.PromoteAlone(ctx, r1)
	require.NoError(t, err)
	require.NoError(t, r3.Follow(ctx, r1))

	// A write on the old primary after the promotion: past the
	// switchpoint of timeline 2, on r2 only.
	oldPool, err := old.Pool(ctx, e.db)
	require.NoError(t, err)
	var idB int64
	require.NoError(t, oldPool.QueryRow(ctx, "INSERT INTO items (v) VALUES ('lost') RETURNING id").Scan(&idB))
	tokB := capture(t, oldPool, "main")
	require.Equal(t, uint32(1), tokB.Entries[0].Epoch.Timeline)
	require.NoError(t, r2.WaitReplay(ctx, tokB.Entries[0].LSN.String()))
	require.True(t, found(t, e.replicas[1], idB), "r2 shows a row the new primary never had")
	newPrimary, err := r1.Pool(ctx, e.db)
	require.NoError(t, err)
	require.False(t, found(t, newPrimary, idB))

	// The application's primary (and the tracker's) moves to r1.
	target.Store(int64(r1.Port()))
	e.primary.Reset()
	require.NoError(t, old.Exec(ctx, "", "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", e.db))
	var ds *replay.DatabaseState
	require.Eventually(t, func() bool {
		ds = r.Snapshot().Database("main")
		return ds.Primary.Err == nil && ds.Primary.Epoch.Timeline == 2 && ds.Primary.HistoryKnown &&
			ds.Replicas[1].Diverged && !ds.Replicas[0].InRecovery && ds.Replicas[0].Observations > 0 &&
			ds.Replicas[2].Err == nil && ds.Replicas[2].Replayed.Epoch.Timeline == 2
	}, 30*time.Second, 10*time.Millisecond, "tracker after the failover: %+v", ds)
	sp, ok := ds.Primary.History.Switchpoint(1)
	require.True(t, ok)
	require.Greater(t, ds.Replicas[1].Replayed.LSN, sp, "r2 replayed past the switchpoint")
	t.Logf("switchpoint %v; r2 on %v at %v", sp, ds.Replicas[1].Replayed.Epoch, ds.Replicas[1].Replayed.LSN)

	// A timeline-1 token of the shared history reads r3, never r2 (which
	// would show row B as well).
	for range 8 {
		hctx, d, err := r.Route(ctx, Job{Token: tokA, Policy: Sticky})
		require.NoError(t, err)
		require.Equal(t, OutcomeReplica, d.Outcome, "%+v", d)
		require.Equal(t, "r3", d.Databases[0].Replica)
		require.True(t, found(t, DB(hctx, "main"), idA))
		require.False(t, found(t, DB(hctx, "main"), idB))
	}
	// Past the switchpoint: the primary, as before.
	_, d, err := r.Route(ctx, Job{Token: tokB, Policy: Delayed})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimaryEpoch, d.Outcome)
	require.Equal(t, position.PastSwitchpoint, d.Databases[0].Incomparable)

	// A new-timeline token is served by r3, never r2.
	e.primary.Reset()
	idC, tokC := e.write(t)
	require.Equal(t, uint32(2), tokC.Entries[0].Epoch.Timeline)
	hctx, d, err := r.Route(ctx, Job{Token: tokC, Policy: Delayed})
	require.NoError(t, err)
	require.Contains(t, []Outcome{OutcomeReplica, OutcomeReplicaWaited}, d.Outcome)
	require.Equal(t, "r3", d.Databases[0].Replica)
	require.True(t, found(t, DB(hctx, "main"), idC))

	// Without r3, nothing can serve a new-timeline token: the job reads the
	// primary at once instead of waiting on r2 (WaitBudget is 20s).
	require.NoError(t, r3.Stop(ctx))
	require.Eventually(t, func() bool {
		return r.Snapshot().Database("main").Replicas[2].Err != nil
	}, 30*time.Second, 10*time.Millisecond)
	idD, tokD := e.write(t)
	hctx, d, err = r.Route(ctx, Job{Token: tokD, Policy: Delayed})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimary, d.Outcome, "%+v", d)
	require.Equal(t, ReasonDivergedStandby, d.Reason)
	require.Zero(t, d.Waited, "no wait on a diverged standby")
	require.Same(t, e.primary, DB(hctx, "main"))
	require.True(t, found(t, DB(hctx, "main"), idD))
	_, d, err = r.Route(ctx, Job{Token: tokA, Policy: Delayed})
	require.NoError(t, err)
	require.Equal(t, ReasonDivergedStandby, d.Reason, "old-timeline tokens do not read it either")
	require.Zero(t, watchers(r, 1), "nobody waits on r2")

	// The diverged gauge says so.
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(ctx, &rm))
	gauge := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "caughtup.consume.replica.diverged" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Gauge[int64]).DataPoints {
				name, _ := dp.Attributes.Value(attrReplica)
				gauge[name.AsString()] = dp.Value
			}
		}
	}
	require.Equal(t, int64(1), gauge["r2"], "gauge %v", gauge)
	require.Equal(t, int64(0), gauge["r3"], "gauge %v", gauge)
}
