package consume

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// BenchmarkConnCheck measures what tying each handler connection to the
// server the decision judged costs a routed job: a point query on the
// application's own pool (bare), the same through a routed context on a
// pool pinned to one standby (pinned: no query added, the connection's
// server is the one judged), and through HAProxy over two caught-up
// standbys (balanced: a connection to the standby the tracker does not
// watch costs one query). It reports the check's queries per job.
//
//	go test -run '^$' -bench ConnCheck -benchtime 2000x ./consume/
func BenchmarkConnCheck(b *testing.B) {
	c, err := pgtest.Start(context.Background(), pgtest.Options{Replicas: 2})
	require.NoError(b, err)
	b.Cleanup(func() { _ = c.Close() })
	e := setup(b, c)
	id, tok := e.write(b)
	h := proxytest.StartHAProxy(b, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
	lb, err := pgxpool.New(context.Background(), fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", h.Addr(), e.db))
	require.NoError(b, err)
	b.Cleanup(lb.Close)
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
	for _, tc := range []struct {
		name string
		pool *pgxpool.Pool
		// other: after the tracker connected, every new connection reaches
		// the standby it does not watch.
		other bool
	}{{"pinned", e.replicas[0], false}, {"balanced", lb, false}, {"other-server", lb, true}} {
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
				for _, p := range r.owned {
					p.Reset()
				}
			}
			verified := func() int64 {
				return sums(b, reader)["caughtup.consume.replica.connections"]["caughtup.result=verified,db.system.name=postgresql"]
			}
			v0 := verified()
			for b.Loop() {
				hctx, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
				if err != nil || d.Databases[0].Replica == "" {
					b.Fatalf("routed %s/%s: %v", d.Outcome, d.Reason, err)
				}
				query(b, DB(hctx, "main"), hctx)
			}
			b.ReportMetric(float64(verified()-v0)/float64(b.N), "check-queries/op")
		})
	}
}
