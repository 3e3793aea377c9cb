package caughtupriver

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// BenchmarkPositionRead measures what stamping fetched jobs costs the
// primary: 32 goroutines (jobs arriving at once, as a fetched batch's do)
// each get a position, either with a query of their own (PerJob: what a
// read per job would cost) or through the shared reads the Middleware
// uses (Shared). ns/op is per job; Shared also reports reads/job (queries
// on the primary per job) and speedup (PerJob's ns/op over Shared's, from
// the PerJob run just before).
func BenchmarkPositionRead(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c := pgtest.Shared(b)
	db := pgtest.NewDatabase(b, c)
	pool, err := pgxpool.New(ctx, c.Primary().DSN(db)+"&pool_max_conns=32")
	require.NoError(b, err)
	defer pool.Close()
	capt := enqueue.NewCapturer(enqueue.Config{})
	var perJob float64
	b.Run("PerJob", func(b *testing.B) {
		b.SetParallelism(16)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				conn, err := pool.Acquire(ctx)
				if err != nil {
					b.Error(err)
					return
				}
				_, err = capt.Capture(ctx, conn.Conn())
				conn.Release()
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
		perJob = float64(b.Elapsed().Nanoseconds()) / float64(b.N)
		b.ReportMetric(1, "reads/job")
	})
	b.Run("Shared", func(b *testing.B) {
		reader := sdkmetric.NewManualReader()
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		defer func() { _ = mp.Shutdown(context.Background()) }()
		met, err := newMetrics(mp)
		require.NoError(b, err)
		p := &fetchPositions{pool: pool, capture: capt, timeout: 30 * time.Second, met: met}
		b.SetParallelism(16)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if _, err := p.token(ctx); err != nil {
					b.Error(err)
					return
				}
			}
		})
		shared := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
		b.ReportMetric(float64(metrictest.Sum(b, reader, "caughtup.river.position.reads"))/float64(b.N), "reads/job")
		if perJob > 0 {
			b.ReportMetric(perJob/shared, "speedup")
		}
	})
}
