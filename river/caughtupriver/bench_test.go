package caughtupriver_test

import (
	"context"
	"math"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/river/caughtupriver"
)

// BenchmarkThroughput measures how many jobs per second a trivial worker
// completes on a plain River client and on one with the Middleware, on the
// shared cluster with caught-up replicas: b.N jobs per run, inserted
// before the client starts (and replayed by the replicas), counted from
// Start to the last job's completion. Each side runs twice, in the order plain, routed, routed,
// plain, after a GC, so that drift on the machine hits both alike; the
// rates are geometric means. Sub-benchmarks: Fetch (jobs inserted without
// a token, as InsertTx's are: routed by the primary's position read after
// their fetch, shared per batch) and Metadata (jobs inserted with Insert
// after a commit: routed by their metadata token, no read), each with a
// trivial worker and with one that makes a point query on a replica
// (PointQuery: the plain worker on a replica pool directly, the routed
// one on the pool the middleware chose). It reports
// river-jobs/s, caughtup-jobs/s, their ratio, and the position reads per
// routed job, and the share of routed jobs that waited for a replica
// (waited/job). A position read after the fetch includes the WAL River
// itself wrote since (fetches, completions), so a replica must replay
// that too before it serves the job, and the jobs waiting for the read
// wait for the tracker's next observation; but the read's scan registers
// the jobs waiting behind them (visibleJobs), which then need no read
// and no wait: Fetch pays that once, for its first batch. Run it with
// -benchtime 5000x -count 5 for stable figures.
func BenchmarkThroughput(b *testing.B) {
	for _, bc := range []struct {
		name           string
		stamped, query bool
	}{
		{"Fetch", false, false},
		{"Metadata", true, false},
		{"FetchPointQuery", false, true},
		{"MetadataPointQuery", true, true},
	} {
		stamped := bc.stamped
		b.Run(bc.name, func(b *testing.B) {
			b.StopTimer()
			e := setup(b)
			ctx := e.write(b, ctxT(b), 1)
			require.NoError(b, e.cluster.WaitReplicasCaughtUp(ctx))
			mw := e.middleware(b, caughtupriver.Config{})
			// River gets a pool of its own, sized for its 50 workers, as a
			// deployment would give it: on the router's primary pool (4
			// connections here) the position reads would queue behind
			// River's fetches and completions.
			rp, err := pgxpool.New(ctx, e.cluster.Primary().DSN(e.primary.Config().ConnConfig.Database)+"&pool_max_conns=20")
			require.NoError(b, err)
			b.Cleanup(rp.Close)
			var plain, routed []float64
			for _, withMW := range []bool{false, true, true, false} {
				rate := runThroughput(b, e, rp, ctx, b.N, withMW, stamped, bc.query, mw)
				if withMW {
					routed = append(routed, rate)
				} else {
					plain = append(plain, rate)
				}
			}
			p, r := geomean(plain), geomean(routed)
			b.ReportMetric(p, "river-jobs/s")
			b.ReportMetric(r, "caughtup-jobs/s")
			b.ReportMetric(r/p, "ratio")
			reads := e.sum(b, readsMetric, nil)
			b.ReportMetric(float64(reads)/float64(2*b.N), "reads/job")
			waited := e.sum(b, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": "replica_waited"})
			b.ReportMetric(float64(waited)/float64(2*b.N), "waited/job")
		})
	}
}

func geomean(xs []float64) float64 {
	s := 0.0
	for _, x := range xs {
		s += math.Log(x)
	}
	return math.Exp(s / float64(len(xs)))
}

type benchArgs struct {
	N int `json:"n"`
}

func (benchArgs) Kind() string { return "bench" }

type benchWorker struct {
	river.WorkerDefaults[benchArgs]
	done  *atomic.Int64
	total int64
	all   chan struct{}
	query func(context.Context) error // nil: a trivial worker
}

func (w *benchWorker) Work(ctx context.Context, _ *river.Job[benchArgs]) error {
	if w.query != nil {
		if err := w.query(ctx); err != nil {
			return err
		}
	}
	if w.done.Add(1) == w.total {
		close(w.all)
	}
	return nil
}

// runThroughput inserts n jobs, then works them on a fresh client (with
// mw if withMW) and returns jobs per second.
func runThroughput(b *testing.B, e *env, pool *pgxpool.Pool, ctx context.Context, n int, withMW, stamped, query bool, mw *caughtupriver.Middleware) float64 {
	b.Helper()
	w := &benchWorker{done: new(atomic.Int64), total: int64(n), all: make(chan struct{})}
	if query {
		// One point query on a replica: the routed worker's from the pool
		// the middleware chose, the plain one's from a replica pool
		// directly (what it would do without caughtup, stale reads and
		// all).
		replica := e.replicas[0]
		w.query = func(ctx context.Context) error {
			q := replica
			if withMW {
				var err error
				if q, err = consume.Pool(ctx, "main"); err != nil {
					return err
				}
			}
			var v string
			return q.QueryRow(ctx, `SELECT val FROM items WHERE id = 1`).Scan(&v)
		}
	}
	ws := river.NewWorkers()
	river.AddWorker(ws, w)
	cfg := &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 50}},
		Workers:           ws,
		FetchCooldown:     5 * time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
		Logger:            clientConfig(1, &itemWorker{}).Logger,
	}
	if withMW {
		cfg.Middleware = []rivertype.Middleware{mw}
	}
	c, err := river.NewClient(riverpgxv5.New(pool), cfg)
	require.NoError(b, err)
	params := make([]river.InsertManyParams, n)
	for i := range params {
		params[i] = river.InsertManyParams{Args: benchArgs{N: i}}
	}
	if stamped {
		_, err = caughtupriver.InsertMany(ctx, c, params)
	} else {
		_, err = c.InsertMany(ctx, params)
	}
	require.NoError(b, err)
	// The replicas replay the inserts (and the last run's DELETE) first,
	// as they would have long before a backlog's jobs are fetched: an
	// InsertTx job waits for its insert's commit on a replica, which is
	// right, and not what this measures.
	require.NoError(b, e.cluster.WaitReplicasCaughtUp(ctx))
	runtime.GC()
	start := time.Now()
	b.StartTimer()
	require.NoError(b, c.Start(ctx))
	select {
	case <-w.all:
	case <-time.After(5 * time.Minute):
		b.Fatalf("%d of %d jobs done after 5 minutes", w.done.Load(), n)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(b, c.Stop(sctx))
	// The completed jobs go, so that the next run fetches only its own.
	_, err = e.primary.Exec(ctx, `DELETE FROM river_job`)
	require.NoError(b, err)
	return float64(n) / elapsed.Seconds()
}
