package caughtupriver_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/river/caughtupriver"
	"github.com/caughtup/caughtup/testkit/catchup"
	"github.com/caughtup/caughtup/testkit/drain"
	"github.com/caughtup/caughtup/testkit/latency"
)

// drainWorkers is every side's MaxWorkers: more than a trivial worker
// needs, so that the drain measures fetching and waking.
const drainWorkers = 100

// BenchmarkDrain measures how fast N snoozed jobs start once they all
// become runnable at once, against plain River starting N jobs made
// available at once, for N = 1,000 and 5,000 (or CAUGHTUP_DRAIN_N), with
// a trivial worker. Each round runs the three sides one after the other,
// in a rotating order (CAUGHTUP_DRAIN_ROUNDS rounds, default 3), each on a
// queue of its own and a client of its own (drainWorkers workers,
// FetchCooldown 5ms, FetchPollInterval 50ms, a pool of 20 connections):
//
//   - caughtup, Insert: every replica's replay is paused, N jobs inserted
//     with Insert and tokens of rows written during the pause (a row per
//     100 jobs) are snoozed by the Middleware (WaitBudget 1ms, snooze 30s,
//     so that nothing but the wake runs them early); once all N are
//     snoozed, replay resumes. Time: from the catch-up of the newest token
//     (catchup.FirstCaughtUp, CatchUp.Read: when the tracker had read the
//     observation that made every job runnable) to the last worker start.
//   - caughtup, InsertTx: the same with jobs inserted by InsertManyTx in
//     the transaction of their row (100 per transaction), whose tokens are
//     the positions read after their first fetch, kept at their snooze.
//   - bare: plain River, the Insert side's jobs (token metadata included)
//     inserted scheduled an hour ahead, then made available in one
//     statement with River's insert notification, as River's scheduler
//     does. Time: from just before that statement to the last start.
//
// The table gives each side's median time over the rounds and the median
// of the rounds' ratios bare/caughtup (≥ 0.9 is issue #35's goal). Starts
// on a replica before their own token's recorded catch-up are counted as
// stale (must be 0); starts on the primary (the router's choice while the
// replicas are over their lag thresholds, which the catch-up's WAL can
// put them) are listed apart. It asserts nothing about time. Run it
// alone (it takes minutes):
//
//	go test -run '^$' -bench Drain -benchtime 1x -timeout 30m ./river/caughtupriver/
func BenchmarkDrain(b *testing.B) {
	if os.Getenv("CAUGHTUP_DRAIN_N") == "" {
		b.Setenv("CAUGHTUP_DRAIN_N", "1000,5000")
	}
	e := setup(b, func(c *consume.Config) {
		c.Tracker.PollInterval = replay.DefaultPollInterval
		c.WaitBudget = time.Millisecond
		c.DeferInitial = 30 * time.Second
		c.DeferMax = 30 * time.Second
	})
	ctx := ctxT(b)
	rp, err := pgxpool.New(ctx, e.cluster.Primary().DSN(e.primary.Config().ConnConfig.Database)+"&pool_max_conns=20")
	require.NoError(b, err)
	b.Cleanup(rp.Close)
	mw := e.middleware(b, caughtupriver.Config{WakeCapacity: 20_000})
	ns, rounds := drain.Sizes(b), drain.Rounds(b)
	type cell struct {
		n                   int
		insert, tx, bare    []time.Duration
		ratios, txRatios    []float64
		offReplica, early   int
		offReasons          map[string]int
		woken, reads, moves int64
	}
	var cells []cell
	round := 0
	for b.Loop() {
		cells = cells[:0]
		for _, n := range ns {
			c := cell{n: n, offReasons: map[string]int{}}
			woken0, reads0 := e.sum(b, wokenMetric, nil), e.sum(b, readsMetric, nil)
			moves0 := e.sum(b, "caughtup.river.wake.errors", nil)
			for r := range rounds {
				round++
				base := int64(round) * 1_000_000
				var it, tt, bt time.Duration
				var s1, s2 drainStale
				drain.RunSides(r,
					func() { it, s1 = drainCaughtup(b, e, rp, mw, n, base, false) },
					func() { tt, s2 = drainCaughtup(b, e, rp, mw, n, base+300_000, true) },
					func() { bt = drainBare(b, e, rp, n, base+600_000) },
				)
				c.insert, c.tx, c.bare = append(c.insert, it), append(c.tx, tt), append(c.bare, bt)
				c.ratios = append(c.ratios, float64(bt)/float64(it))
				c.txRatios = append(c.txRatios, float64(bt)/float64(tt))
				for _, s := range []drainStale{s1, s2} {
					c.offReplica += s.offReplica
					c.early += s.early
					for k, v := range s.reasons {
						c.offReasons[k] += v
					}
				}
			}
			c.woken = e.sum(b, wokenMetric, nil) - woken0
			c.reads = e.sum(b, readsMetric, nil) - reads0
			c.moves = e.sum(b, "caughtup.river.wake.errors", nil) - moves0
			cells = append(cells, c)
		}
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "\n| River, %d workers | N | caughtup Insert: catch-up → last start (median) | caughtup InsertTx (median) | bare: available → last start (median) | ratio bare/Insert (median; min–max) | ratio bare/InsertTx (median; min–max) | rounds | woken | wake attempts not moved | position reads | on the primary (by outcome/reason) | stale: on a replica before the recorded catch-up |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", drainWorkers)
	for _, c := range cells {
		fmt.Fprintf(&tb, "| River | %d | %v | %v | %v | %.2f (%.2f–%.2f) | %.2f (%.2f–%.2f) | %d | %d | %d | %d | %d %v | %d |\n", c.n,
			median(c.insert).Round(time.Millisecond), median(c.tx).Round(time.Millisecond), median(c.bare).Round(time.Millisecond),
			drain.Median(c.ratios), slices.Min(c.ratios), slices.Max(c.ratios),
			drain.Median(c.txRatios), slices.Min(c.txRatios), slices.Max(c.txRatios),
			len(c.ratios), c.woken, c.moves, c.reads, c.offReplica, c.offReasons, c.early)
		b.ReportMetric(drain.Median(c.ratios), fmt.Sprintf("ratio-insert-%d", c.n))
		b.ReportMetric(drain.Median(c.txRatios), fmt.Sprintf("ratio-inserttx-%d", c.n))
	}
	b.Log(tb.String())
}

func median(s []time.Duration) time.Duration { return latency.Percentile(s, 0.5) }

type drainArgs struct {
	I int `json:"i"`
}

func (drainArgs) Kind() string { return "drain" }

type drainWorker struct {
	river.WorkerDefaults[drainArgs]
	st *drain.Starts
	// off counts the starts not on a replica (the primary, which has
	// every write), by outcome and reason, and offJob marks their jobs;
	// nil: not routed.
	off    *sync.Map
	offJob []atomic.Bool
}

// drainStale is what a caughtup side counts as stale.
type drainStale struct {
	offReplica, early int
	reasons           map[string]int
}

func (w *drainWorker) Work(ctx context.Context, job *river.Job[drainArgs]) error {
	at := time.Now()
	if w.off != nil {
		if d, ok := consume.DecisionFrom(ctx); !ok || d.Outcome != consume.OutcomeReplica && d.Outcome != consume.OutcomeReplicaWaited {
			n, _ := w.off.LoadOrStore(d.Outcome.String()+"/"+d.Reason.String(), new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			if job.Args.I >= 0 && job.Args.I < len(w.offJob) {
				w.offJob[job.Args.I].Store(true)
			}
		}
	}
	w.st.Start(job.Args.I, at)
	return nil
}

// drainClient starts a client on its own queue working drain jobs into st,
// with mw when it is not nil; stop (idempotent) stops it, and so waits
// for River's completer, before the side deletes its jobs.
func drainClient(b *testing.B, pool *pgxpool.Pool, queue string, w *drainWorker, mw rivertype.Middleware) (*river.Client[pgx.Tx], func()) {
	ws := river.NewWorkers()
	river.AddWorker(ws, w)
	cfg := &river.Config{
		Queues:            map[string]river.QueueConfig{queue: {MaxWorkers: drainWorkers}},
		Workers:           ws,
		FetchCooldown:     5 * time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
		Logger:            clientConfig(1, &itemWorker{}).Logger,
	}
	if mw != nil {
		cfg.Middleware = []rivertype.Middleware{mw}
	}
	c, err := river.NewClient(riverpgxv5.New(pool), cfg)
	require.NoError(b, err)
	require.NoError(b, c.Start(context.Background()))
	var once sync.Once
	return c, func() {
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			require.NoError(b, c.Stop(ctx))
		})
	}
}

var drainQueues atomic.Int64

func drainQueue() string { return fmt.Sprintf("drain_%d", drainQueues.Add(1)) }

// drainTokens writes a row per 100 of n jobs (ids from base) and returns
// their tokens.
func drainTokens(b *testing.B, e *env, n int, base int64) []position.Token {
	toks := make([]position.Token, (n+99)/100)
	for k := range toks {
		toks[k], _ = enqueue.TokenFrom(e.write(b, context.Background(), base+int64(k)))
	}
	return toks
}

// insertDrain inserts jobs 0..n-1 on queue: with Insert and the token of
// their hundred (toks), or, with tx, by InsertManyTx in the transaction
// writing their hundred's row (ids from base).
func insertDrain(b *testing.B, e *env, c *river.Client[pgx.Tx], queue string, n int, toks []position.Token, tx bool, base int64, scheduled time.Time) {
	ctx := context.Background()
	for k := 0; k*100 < n; k++ {
		params := make([]river.InsertManyParams, 0, 100)
		for i := k * 100; i < min(n, (k+1)*100); i++ {
			params = append(params, river.InsertManyParams{Args: drainArgs{I: i}, InsertOpts: &river.InsertOpts{Queue: queue, ScheduledAt: scheduled}})
		}
		if !tx {
			_, err := caughtupriver.InsertMany(enqueue.WithToken(ctx, toks[k]), c, params)
			require.NoError(b, err)
			continue
		}
		require.NoError(b, pgx.BeginFunc(ctx, e.primary, func(t pgx.Tx) error {
			if _, err := t.Exec(ctx, `INSERT INTO items (id, val) VALUES ($1, $2)`, base+int64(k), value(base+int64(k))); err != nil {
				return err
			}
			_, err := c.InsertManyTx(ctx, t, params)
			return err
		}))
	}
}

// drainCaughtup runs a caughtup side of one round and returns catch-up →
// last start and the starts that were stale.
func drainCaughtup(b *testing.B, e *env, pool *pgxpool.Pool, mw *caughtupriver.Middleware, n int, base int64, tx bool) (time.Duration, drainStale) {
	ctx := context.Background()
	queue := drainQueue()
	w := &drainWorker{st: drain.NewStarts(n), off: new(sync.Map), offJob: make([]atomic.Bool, n)}
	c, stop := drainClient(b, pool, queue, w, mw)
	defer stop()
	resume := e.pauseAll(b)
	var toks []position.Token
	if !tx {
		toks = drainTokens(b, e, n, base)
	}
	insertDrain(b, e, c, queue, n, toks, tx, base, time.Time{})
	// Every job snoozed, for 30s: scheduled.
	deadline := time.Now().Add(3 * time.Minute)
	for {
		var snoozed int
		require.NoError(b, e.primary.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE queue = $1 AND state = 'scheduled'`, queue).Scan(&snoozed))
		if snoozed == n {
			break
		}
		if time.Now().After(deadline) {
			var states string
			_ = e.primary.QueryRow(ctx, `SELECT string_agg(state || ' ' || n, ', ') FROM (SELECT state::text, count(*) AS n FROM river_job WHERE queue = $1 GROUP BY state) s`, queue).Scan(&states)
			b.Fatalf("caughtup side: %d of %d jobs snoozed within 3 minutes (jobs by state: %s; %d started)", snoozed, n, states, w.st.Started())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if started := w.st.Started(); started > 0 {
		b.Fatalf("caughtup side: %d jobs ran while every replica was paused", started)
	}
	// Each job's token: its metadata token, or the position kept at its
	// snooze.
	jobToks := make([]position.Token, n)
	rows, err := e.primary.Query(ctx, `SELECT (args->>'i')::int, metadata FROM river_job WHERE queue = $1`, queue)
	require.NoError(b, err)
	for rows.Next() {
		var i int
		var md []byte
		require.NoError(b, rows.Scan(&i, &md))
		jobToks[i] = drainJobToken(b, md)
	}
	require.NoError(b, rows.Err())
	newest := jobToks[0]
	for _, t := range jobToks[1:] {
		newest = newest.Merge(t)
	}
	runtime.GC()
	stopFollow := latency.Follow(e.router.Snapshot)
	resume()
	w.st.Wait(b, "caughtup side")
	recorded := stopFollow()
	cfg := e.router.Config()
	caught, ok := catchup.FirstCaughtUp(newest, recorded, &cfg)
	require.True(b, ok, "the recorded snapshots never show the newest token caught up")
	bad := drainStale{reasons: map[string]int{}}
	w.off.Range(func(k, v any) bool {
		bad.reasons[k.(string)] = int(v.(*atomic.Int64).Load())
		bad.offReplica += bad.reasons[k.(string)]
		return true
	})
	for i := range n {
		if w.offJob[i].Load() {
			continue // on the primary: not stale, counted in offReplica
		}
		if c, ok := catchup.FirstCaughtUp(jobToks[i], recorded, &cfg); !ok || w.st.At(i).Before(c.Read) {
			bad.early++
		}
	}
	stop()
	_, err = e.primary.Exec(ctx, `DELETE FROM river_job WHERE queue = $1`, queue)
	require.NoError(b, err)
	return w.st.Last().Sub(caught.Read), bad
}

// drainJobToken is the token a snoozed job is routed by: its metadata
// token, else the position kept at its snooze.
func drainJobToken(b *testing.B, md []byte) position.Token {
	tok, ok, err := caughtupriver.TokenOf(&rivertype.JobRow{Metadata: md})
	require.NoError(b, err)
	if ok {
		return tok
	}
	var v struct {
		Snoozed struct {
			Token string `json:"token"`
		} `json:"caughtup-snoozed"`
	}
	require.NoError(b, json.Unmarshal(md, &v))
	tok, err = position.DecodeHeaders(v.Snoozed.Token)
	require.NoError(b, err)
	require.False(b, tok.IsZero(), "a snoozed InsertTx job without a kept position: %s", md)
	return tok
}

// drainBare runs the bare side of one round: plain River, the Insert
// side's jobs scheduled an hour ahead, made available in one statement
// that also sends River's insert notification for the queue.
func drainBare(b *testing.B, e *env, pool *pgxpool.Pool, n int, base int64) time.Duration {
	ctx := context.Background()
	queue := drainQueue()
	w := &drainWorker{st: drain.NewStarts(n)}
	c, stop := drainClient(b, pool, queue, w, nil)
	defer stop()
	insertDrain(b, e, c, queue, n, drainTokens(b, e, n, base), false, base, time.Now().Add(time.Hour))
	runtime.GC()
	t0 := time.Now()
	var moved int
	require.NoError(b, e.primary.QueryRow(ctx, `WITH moved AS (
			UPDATE river_job SET state = 'available', scheduled_at = now() WHERE queue = $1 AND state = 'scheduled' RETURNING id
		)
		SELECT count(*) FROM moved, (SELECT pg_notify(current_schema() || '.river_insert', json_build_object('queue', $1::text)::text)) AS n`, queue).Scan(&moved))
	require.Equal(b, n, moved)
	w.st.Wait(b, "bare side")
	stop()
	_, err := e.primary.Exec(ctx, `DELETE FROM river_job WHERE queue = $1`, queue)
	require.NoError(b, err)
	return w.st.Last().Sub(t0)
}
