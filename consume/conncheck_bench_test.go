package consume

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// BenchmarkConnCheck measures what tying each handler connection to a
// server known to have replayed the job's token costs a routed job: a
// point query on the application's own pool (bare), the same through a
// routed context on a pool pinned to one standby (pinned: no query added),
// through HAProxy over two caught-up standbys (balanced: a connection to
// the standby the tracker does not watch costs one query until the pool
// has seen that server replay the token), with every new connection on the
// standby the tracker does not watch (other-server), and through
// PgBouncer in transaction pooling over that HAProxy (pooled-multiplexed:
// every acquire checked in the transaction its read runs in, two round
// trips; bare-pooled is the same read on the PgBouncer pool without
// caughtup). It reports the check queries per job.
//
//	go test -run '^$' -bench ConnCheck -benchtime 2000x ./consume/
func BenchmarkConnCheck(b *testing.B) {
	c, err := pgtest.Start(context.Background(), pgtest.Options{Replicas: 2})
	require.NoError(b, err)
	b.Cleanup(func() { _ = c.Close() })
	e := setup(b, c)
	id, tok := e.write(b)
	h := proxytest.StartHAProxy(b, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
	lb, err := pgxpool.New(context.Background(), haproxyDSN(h, e.db))
	require.NoError(b, err)
	b.Cleanup(lb.Close)
	bo := proxytest.StartPgBouncer(b, proxytest.PgBouncerConfig{Backends: []string{h.Addr()}})
	pooled, err := pgxpool.New(context.Background(), bo.DSN(e.db)+"&default_query_exec_mode=simple_protocol")
	require.NoError(b, err)
	b.Cleanup(pooled.Close)
	ctx := context.Background()

	query := func(b *testing.B, pool *pgxpool.Pool, ctx context.Context) {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM items WHERE id = $1", id).Scan(&n); err != nil || n != 1 {
			b.Fatalf("read: n=%d err=%v", n, err)
		}
	}
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			query(b, e.replicas[0], ctx)
		}
	})
	// The pooler's own cost, without caughtup: the side pooled-multiplexed
	// compares with.
	b.Run("bare-pooled", func(b *testing.B) {
		for b.Loop() {
			query(b, pooled, ctx)
		}
	})
	for _, tc := range []struct {
		name string
		pool *pgxpool.Pool
		// other: after the tracker connected, every new connection reaches
		// the standby it does not watch.
		other bool
	}{{"pinned", e.replicas[0], false}, {"balanced", lb, false}, {"other-server", lb, true}, {"pooled-multiplexed", pooled, false}} {
		b.Run(tc.name, func(b *testing.B) {
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			b.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
			r := e.router(b, func(cfg *Config) {
				cfg.Databases = map[string]replay.Database{"main": {Primary: e.primary, Replicas: []replay.Replica{{Name: "r", Pool: tc.pool}}}}
				cfg.MeterProvider = mp
			})
			seen(b, r, tok)
			if tc.other {
				watched, _ := (&balancedEnv{env: e, c: c, r: r}).watched(b)
				for i, n := range c.Replicas() {
					if n == watched {
						require.NoError(b, h.SetState(h.Server(i), proxytest.Maint))
						b.Cleanup(func() { _ = h.SetState(h.Server(i), proxytest.Ready) })
					}
				}
				(&balancedEnv{r: r}).resetHandlers()
			}
			checks := func() int64 {
				sets := sums(b, reader)["caughtup.consume.replica.connections"]
				return sets["caughtup.result=verified,db.system.name=postgresql"] + sets["caughtup.result=in_transaction,db.system.name=postgresql"]
			}
			v0 := checks()
			for b.Loop() {
				hctx, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
				if err != nil || d.Databases[0].Replica == "" {
					b.Fatalf("routed %s/%s: %v", d.Outcome, d.Reason, err)
				}
				query(b, DB(hctx, "main"), hctx)
			}
			b.ReportMetric(float64(checks()-v0)/float64(b.N), "check-queries/op")
		})
	}
}
