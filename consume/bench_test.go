package consume

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/latency"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// BenchmarkRoute is the whole in-process path for a caught-up job:
// snapshot, Decide, metrics, context values and the child token.
func BenchmarkRoute(b *testing.B) {
	e := setup(b, pgtest.Shared(b))
	r := e.router(b, func(c *Config) { c.Logger = nil })
	_, tok := e.write(b)
	seen(b, r, tok)
	header, _ := tok.Encode()
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, d, err := r.Route(ctx, hjob(header, Delayed)); err != nil || d.Outcome != OutcomeReplica {
			b.Fatal(d.Outcome, err)
		}
	}
}

// BenchmarkRouteSDKMetrics is BenchmarkRoute recording into an SDK
// MeterProvider, as in production, from parallel workers.
func BenchmarkRouteSDKMetrics(b *testing.B) {
	e := setup(b, pgtest.Shared(b))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	b.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := e.router(b, func(c *Config) { c.Logger = nil; c.MeterProvider = mp })
	_, tok := e.write(b)
	seen(b, r, tok)
	header, _ := tok.Encode()
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, d, err := r.Route(ctx, hjob(header, Delayed)); err != nil || d.Outcome != OutcomeReplica {
				b.Error(d.Outcome, err)
				return
			}
		}
	})
}

// BenchmarkCatchUpLatency measures how soon a waiting job learns that its
// replica has caught up. Per sample: pause replay on the replica, write
// and capture a token, start Route (Delayed) and wait until it is waiting,
// resume replay, and take two times from Route's return:
//
//   - catchup: since a separate poller, looping on its own connection,
//     first saw pg_last_wal_replay_lsn() >= token (midpoint of that
//     query's round trip): the delay the tracker adds on top of replay;
//   - resume: since pg_wal_replay_resume() was sent, which adds the
//     replica's own time to replay the record.
//
// Run with -benchtime=1000x for 1,000 samples; it reports p50/p99 and never
// asserts wall-clock times.
func BenchmarkCatchUpLatency(b *testing.B) {
	c := pgtest.Shared(b)
	e := setup(b, c)
	e.replicas = e.replicas[:1]
	r := e.router(b, func(c *Config) { c.WaitBudget = 10 * time.Second; c.Logger = nil })
	ctx := ctxT(b)
	dsn := c.Replicas()[0].DSN(e.db)
	ctl, err := pgx.Connect(ctx, dsn)
	require.NoError(b, err)
	defer ctl.Close(context.Background())
	probe, err := pgx.Connect(ctx, dsn)
	require.NoError(b, err)
	defer probe.Close(context.Background())
	b.Cleanup(func() { _ = c.Replicas()[0].ResumeReplay(context.Background()) })

	var catchup, resume []time.Duration
	waitedSamples := 0
	for b.Loop() {
		require.NoError(b, pgtest.RequestReplayPause(ctx, ctl))
		_, tok := e.write(b)
		target := tok.Entries[0].LSN

		type result struct {
			d   Decision
			err error
			at  time.Time
		}
		done := make(chan result, 1)
		go func() {
			_, d, err := r.Route(ctx, Job{Token: tok, Policy: Delayed})
			done <- result{d, err, time.Now()}
		}()
		waitUntil(b, r, "the job waits", func(*replay.Snapshot) bool { return watchers(r, 0) > 0 })
		passed := make(chan time.Time, 1)
		go func() {
			for {
				var s string
				sent := time.Now()
				if err := probe.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text").Scan(&s); err != nil {
					passed <- time.Time{}
					return
				}
				if l, _ := position.ParseLSN(s); l >= target {
					passed <- sent.Add(time.Since(sent) / 2)
					return
				}
			}
		}()
		resumeSent := time.Now()
		_, err = ctl.Exec(ctx, "SELECT pg_wal_replay_resume()")
		require.NoError(b, err)
		res := <-done
		pass := <-passed
		if res.err != nil {
			rs := r.Snapshot().Database("main").Replicas[0]
			b.Fatalf("sample %d: %v; token %v; passed %v before return; replica %+v; waiters %d", len(catchup), res.err, target, res.at.Sub(pass), rs, watchers(r, 0))
		}
		require.False(b, pass.IsZero())
		if res.d.Outcome != OutcomeReplicaWaited {
			continue
		}
		waitedSamples++
		catchup = append(catchup, res.at.Sub(pass))
		resume = append(resume, res.at.Sub(resumeSent))
	}
	if len(catchup) == 0 {
		return
	}
	b.ReportMetric(float64(latency.Percentile(catchup, 0.50).Microseconds()), "catchup-p50-µs")
	b.ReportMetric(float64(latency.Percentile(catchup, 0.99).Microseconds()), "catchup-p99-µs")
	b.ReportMetric(float64(latency.Percentile(resume, 0.50).Microseconds()), "resume-p50-µs")
	b.ReportMetric(float64(latency.Percentile(resume, 0.99).Microseconds()), "resume-p99-µs")
	b.Logf("%d samples (%d waited): catch-up p50 %v p99 %v; from resume p50 %v p99 %v",
		b.N, waitedSamples, latency.Percentile(catchup, 0.5), latency.Percentile(catchup, 0.99),
		latency.Percentile(resume, 0.5), latency.Percentile(resume, 0.99))
}

// BenchmarkTrackerQueries routes caught-up jobs from 4 workers at a
// paced rate and reports the tracker's queries per second next to the
// decisions per second: the first stays at one query per node per
// PollInterval (3 nodes, 50ms: 60/s) whatever the second.
func BenchmarkTrackerQueries(b *testing.B) {
	for _, perSecond := range []int{100, 10000} {
		b.Run(fmt.Sprintf("rate=%d", perSecond), func(b *testing.B) {
			e := setup(b, pgtest.Shared(b))
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			b.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
			r := e.router(b, func(c *Config) { c.Logger = nil; c.MeterProvider = mp })
			_, tok := e.write(b)
			seen(b, r, tok)
			queries := func() int64 { return total(sums(b, reader)["caughtup.consume.tracker.queries"]) }
			lim := rate.NewLimiter(rate.Limit(perSecond), max(1, perSecond/100))
			ctx := ctxT(b)
			b.SetParallelism(2) // 4 workers on 2 cores
			q0, start := queries(), time.Now()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := lim.Wait(ctx); err != nil {
						b.Error(err)
						return
					}
					if _, d, err := r.Route(ctx, Job{Token: tok, Policy: Delayed}); err != nil || d.Outcome != OutcomeReplica {
						b.Errorf("outcome %s: %v", d.Outcome, err)
						return
					}
				}
			})
			b.StopTimer()
			el := time.Since(start).Seconds()
			b.ReportMetric(float64(queries()-q0)/el, "queries/s")
			b.ReportMetric(float64(b.N)/el, "decisions/s")
		})
	}
}
