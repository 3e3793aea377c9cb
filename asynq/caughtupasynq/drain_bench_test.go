package caughtupasynq_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/catchup"
	"github.com/caughtup/caughtup/testkit/drain"
	"github.com/caughtup/caughtup/testkit/latency"
)

// drainConcurrency is both sides' asynq Concurrency: more workers than
// the handlers need, so that the drain measures moving and fetching tasks.
const drainConcurrency = 250

// BenchmarkDrain measures how fast N deferred tasks start once they all
// become runnable at once (issue #27), against plain asynq starting N
// tasks made pending at once, for N = 1,000, 5,000 and 10,000 (or
// CAUGHTUP_DRAIN_N, comma-separated), with a trivial handler and with one
// that sleeps 1ms. Each round runs the three sides one after the other,
// in a rotating order (CAUGHTUP_DRAIN_ROUNDS rounds, default 3), on fresh
// queues of the shared redis-server:
//
//   - caughtup: every replica's replay is paused, N tasks stamped with
//     tokens written during the pause (a row per 100 tasks) are enqueued
//     and deferred by NewServer's middleware (WaitBudget 1ms, deferral
//     delay 30s, so that nothing but the wake runs them early); once all N
//     are in the retry set, replay resumes. Time: from the catch-up of the
//     newest token (catchup.FirstCaughtUp, CatchUp.Read: when the tracker
//     had read the observation that made every task runnable) to the last
//     handler start.
//   - bare: asynq.NewServer with the asynq.Config ServerConfig gives the
//     caughtup side (Concurrency, TaskCheckInterval 20ms,
//     DelayedTaskCheckInterval 1s), N tasks scheduled an hour ahead, then
//     made pending in one call (Inspector.RunAllScheduledTasks). Time:
//     from just before that call to the last handler start. The tasks are
//     the caughtup side's, token headers included (tokens of rows written
//     just before), so that the two differ in what the server does with
//     them only.
//   - bare, unstamped: bare with tasks that carry no header.
//
// The table gives each side's median time over the rounds and the median
// of the rounds' ratios bare/caughtup (≥ 0.9 is issue #27's goal). Handler
// starts that were not on a replica, or came before their token's
// catch-up, are counted as stale (must be 0). It asserts nothing about
// time. Run it alone (it takes minutes):
//
//	go test -run '^$' -bench Drain -benchtime 1x -timeout 30m ./asynq/caughtupasynq/
func BenchmarkDrain(b *testing.B) {
	e := setup(b, func(c *consume.Config) {
		c.Tracker.PollInterval = replay.DefaultPollInterval
		c.WaitBudget = time.Millisecond
		c.DeferInitial = 30 * time.Second
		c.DeferMax = 30 * time.Second
	})
	ns := drain.Sizes(b)
	rounds := drain.Rounds(b)
	type cell struct {
		n                         int
		handler                   string
		caughtup, bare, unstamped []time.Duration
		ratios, unstampedRatios   []float64
		stale                     int
		woken                     int64
		errs                      string
	}
	var cells []cell
	round := 0
	for b.Loop() {
		cells = cells[:0]
		for _, n := range ns {
			for _, hd := range []time.Duration{0, time.Millisecond} {
				c := cell{n: n, handler: "trivial"}
				if hd > 0 {
					c.handler = "1 ms"
				}
				woken0 := e.sum(b, "caughtup.asynq.wake.tasks", nil)
				errs0 := map[string]int64{}
				for _, k := range wakeErrorTypes {
					errs0[k] = e.wakeErrors(b, k)
				}
				for r := range rounds {
					round++
					base := int64(round) * 100_000
					var ct, bt, ut time.Duration
					var stale int
					drain.RunSides(r,
						func() { ct, stale = drainCaughtup(b, e, n, hd, base) },
						func() { bt = drainBare(b, e, n, hd, drainTokens(b, e, n, base+50_000)) },
						func() { ut = drainBare(b, e, n, hd, nil) },
					)
					c.caughtup = append(c.caughtup, ct)
					c.bare = append(c.bare, bt)
					c.unstamped = append(c.unstamped, ut)
					c.ratios = append(c.ratios, float64(bt)/float64(ct))
					c.unstampedRatios = append(c.unstampedRatios, float64(ut)/float64(ct))
					c.stale += stale
				}
				c.woken = e.sum(b, "caughtup.asynq.wake.tasks", nil) - woken0
				var errs []string
				for _, k := range wakeErrorTypes {
					if d := e.wakeErrors(b, k) - errs0[k]; d > 0 {
						errs = append(errs, fmt.Sprintf("%s %d", k, d))
					}
				}
				c.errs = strings.Join(errs, ", ")
				cells = append(cells, c)
			}
		}
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "\n| asynq, %d workers | N | handler | caughtup: catch-up → last start (median) | bare: pending → last start (median) | ratio bare/caughtup (median; min–max) | bare, unstamped (median) | ratio unstamped/caughtup (median; min–max) | rounds | woken | not woken | stale |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n", drainConcurrency)
	for _, c := range cells {
		fmt.Fprintf(&tb, "| asynq | %d | %s | %v | %v | %.2f (%.2f–%.2f) | %v | %.2f (%.2f–%.2f) | %d | %d | %s | %d |\n", c.n, c.handler,
			median(c.caughtup).Round(time.Millisecond), median(c.bare).Round(time.Millisecond),
			drain.Median(c.ratios), slices.Min(c.ratios), slices.Max(c.ratios),
			median(c.unstamped).Round(time.Millisecond), drain.Median(c.unstampedRatios), slices.Min(c.unstampedRatios), slices.Max(c.unstampedRatios),
			len(c.ratios), c.woken, c.errs, c.stale)
		h := strings.ReplaceAll(c.handler, " ", "")
		b.ReportMetric(drain.Median(c.ratios), fmt.Sprintf("ratio-%d-%s", c.n, h))
		b.ReportMetric(drain.Median(c.unstampedRatios), fmt.Sprintf("ratio-unstamped-%d-%s", c.n, h))
	}
	b.Log(tb.String())
}

var drainProfiles atomic.Int64

// drainProfile starts a CPU profile of one caughtup drain (resume → last
// start) if CAUGHTUP_DRAIN_CPUPROFILE names a file prefix: each drain
// writes <prefix>.<n>; go tool pprof takes them all at once. Not with
// -cpuprofile.
func drainProfile(b *testing.B) (stop func()) {
	prefix := os.Getenv("CAUGHTUP_DRAIN_CPUPROFILE")
	if prefix == "" {
		return func() {}
	}
	f, err := os.Create(fmt.Sprintf("%s.%d", prefix, drainProfiles.Add(1)))
	require.NoError(b, err)
	require.NoError(b, pprof.StartCPUProfile(f))
	return func() {
		pprof.StopCPUProfile()
		require.NoError(b, f.Close())
	}
}

func median(s []time.Duration) time.Duration { return latency.Percentile(s, 0.5) }

// enqueueAll enqueues n tasks through enq, 8 at a time.
func enqueueAll(b *testing.B, n int, enq func(i int) error) {
	var wg sync.WaitGroup
	var next atomic.Int64
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := enq(i); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(b, err)
	}
}

// drainCaughtup runs the caughtup side of one round and returns catch-up
// → last start and the handler starts that were stale.
func drainCaughtup(b *testing.B, e *env, n int, work time.Duration, base int64) (time.Duration, int) {
	ctx := context.Background()
	queue := queueName(b)
	st := drain.NewStarts(n)
	var stale atomic.Int64
	mux := asynq.NewServeMux()
	mux.HandleFunc("drain", func(ctx context.Context, task *asynq.Task) error {
		at := time.Now()
		i, err := strconv.Atoi(string(task.Payload()))
		if err != nil {
			return err
		}
		if d, ok := consume.DecisionFrom(ctx); !ok || d.Outcome != consume.OutcomeReplica && d.Outcome != consume.OutcomeReplicaWaited {
			stale.Add(1) // not on a caught-up replica: the pause was not measured
		}
		st.Start(i, at)
		if work > 0 {
			time.Sleep(work)
		}
		return nil
	})
	capacity := max(n, caughtupasynq.DefaultWakeCapacity)
	srv, err := caughtupasynq.NewServer(e.opt, asynq.Config{Concurrency: drainConcurrency, Queues: map[string]int{queue: 1}, LogLevel: asynq.ErrorLevel},
		e.router, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed, MeterProvider: e.mp, Logger: slog.New(slog.DiscardHandler), WakeCapacity: capacity})
	require.NoError(b, err)
	require.NoError(b, srv.Start(mux))
	defer srv.Shutdown()

	for _, nd := range e.cluster.Replicas() {
		require.NoError(b, nd.PauseReplay(ctx))
	}
	resumed := false
	defer func() {
		if !resumed {
			for _, nd := range e.cluster.Replicas() {
				_ = nd.ResumeReplay(context.Background())
			}
		}
	}()
	// A row per 100 tasks: tokens past what the paused replicas have.
	toks := drainTokens(b, e, n, base)
	newest := toks[len(toks)-1]
	enqueueAll(b, n, func(i int) error {
		tctx := enqueue.WithToken(ctx, toks[i/100])
		_, err := e.client.EnqueueContext(tctx, caughtupasynq.NewTask(tctx, "drain", []byte(strconv.Itoa(i)), asynq.Queue(queue), asynq.MaxRetry(5)))
		return err
	})
	// Every task deferred: in the retry set (the middleware remembered it
	// before returning its deferral).
	deadline := time.Now().Add(3 * time.Minute)
	for {
		qi, err := e.inspector.GetQueueInfo(queue)
		if err == nil && qi.Retry == n {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("caughtup side: not all %d tasks deferred within 3 minutes (%+v, %v)", n, qi, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if started := st.Started(); started > 0 {
		b.Fatalf("caughtup side: %d tasks ran while every replica was paused", started)
	}
	runtime.GC()
	stopProfile := drainProfile(b)
	stopFollow := latency.Follow(e.router.Snapshot)
	for _, nd := range e.cluster.Replicas() {
		require.NoError(b, nd.ResumeReplay(ctx))
	}
	resumed = true
	st.Wait(b, "caughtup side")
	stopProfile()
	recorded := stopFollow()
	cfg := e.router.Config()
	caught, ok := catchup.FirstCaughtUp(newest, recorded, &cfg)
	require.True(b, ok, "the recorded snapshots never show the newest token caught up")
	// A start before its own token's catch-up would be stale.
	bad := int(stale.Load())
	for i := range n {
		if c, ok := catchup.FirstCaughtUp(toks[i/100], recorded, &cfg); !ok || st.At(i).Before(c.Read) {
			bad++
		}
	}
	return st.Last().Sub(caught.Read), bad
}

// drainTokens writes a row per 100 of n tasks (ids from base) and
// returns their tokens.
func drainTokens(b *testing.B, e *env, n int, base int64) []position.Token {
	toks := make([]position.Token, (n+99)/100)
	for k := range toks {
		wctx := e.write(b, context.Background(), base+int64(k))
		toks[k], _ = enqueue.TokenFrom(wctx)
	}
	return toks
}

// drainBare runs a bare side of one round: plain asynq, same config, n
// tasks made pending at once, task i stamped with toks[i/100] as the
// caughtup side's are (nil: unstamped).
func drainBare(b *testing.B, e *env, n int, work time.Duration, toks []position.Token) time.Duration {
	queue := queueName(b)
	st := drain.NewStarts(n)
	mux := asynq.NewServeMux()
	mux.HandleFunc("drain", func(ctx context.Context, task *asynq.Task) error {
		at := time.Now()
		i, err := strconv.Atoi(string(task.Payload()))
		if err != nil {
			return err
		}
		st.Start(i, at)
		if work > 0 {
			time.Sleep(work)
		}
		return nil
	})
	srv := asynq.NewServer(e.opt, caughtupasynq.ServerConfig(asynq.Config{Concurrency: drainConcurrency, Queues: map[string]int{queue: 1}, LogLevel: asynq.ErrorLevel}))
	require.NoError(b, srv.Start(mux))
	defer srv.Shutdown()
	enqueueAll(b, n, func(i int) error {
		task := asynq.NewTask("drain", []byte(strconv.Itoa(i)))
		if toks != nil {
			task = caughtupasynq.NewTask(enqueue.WithToken(context.Background(), toks[i/100]), "drain", []byte(strconv.Itoa(i)))
		}
		_, err := e.raw.Enqueue(task, asynq.Queue(queue), asynq.MaxRetry(5), asynq.ProcessIn(time.Hour))
		return err
	})
	runtime.GC()
	t0 := time.Now()
	moved, err := e.inspector.RunAllScheduledTasks(queue)
	require.NoError(b, err)
	require.Equal(b, n, moved)
	st.Wait(b, "bare side")
	return st.Last().Sub(t0)
}
