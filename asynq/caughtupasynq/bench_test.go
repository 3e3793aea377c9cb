package caughtupasynq_test

import (
	"context"
	"log/slog"
	"math"
	"runtime"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// BenchmarkServerThroughput measures how many tasks per second a trivial
// handler completes with and without caughtup (NewServer routing a
// caught-up token) against the shared redis-server: b.N tasks per side,
// twice. The two servers run at the same time, one per side, on queues of
// the same size, and each side's rate is counted in the window where both
// were busy, so that load from elsewhere on the machine hits both alike.
// The sides differ in routing only: the plain asynq server gets the
// settings ServerConfig gives caughtup's (DelayedTaskCheckInterval,
// TaskCheckInterval), both run the same handler, and the pair runs once
// with each side enqueued and started first (the ratio is the geometric
// mean of the two), after a GC. It reports asynq-tasks/s,
// caughtup-tasks/s and their ratio (target ≥ 0.97), and the share of
// caughtup's tasks that waited for a fresh replica observation (a
// tracker left stale by a loaded machine); ns/op is the wall time per
// task pair. Run it with -benchtime 3000x -count 5 for stable
// figures.
func BenchmarkServerThroughput(b *testing.B) {
	e := setup(b)
	ctx := e.write(b, ctxT(b), 1)
	require.NoError(b, e.cluster.WaitReplicasCaughtUp(ctx))
	tok, _ := enqueue.TokenFrom(ctx)
	header := encode(b, tok)
	b.Run("Paired", func(b *testing.B) {
		b.StopTimer()
		var rp, rw [2]float64
		var waited int64
		for i, caughtupFirst := range []bool{false, true} {
			var n int64
			rp[i], rw[i], n = pairedThroughput(b, e, header, caughtupFirst)
			waited += n
		}
		b.ReportMetric(math.Sqrt(rp[0]*rp[1]), "asynq-tasks/s")
		b.ReportMetric(math.Sqrt(rw[0]*rw[1]), "caughtup-tasks/s")
		b.ReportMetric(math.Sqrt(rw[0]/rp[0]*rw[1]/rp[1]), "ratio")
		b.ReportMetric(float64(waited)/float64(2*b.N), "caughtup-waited/task")
	})
}

// pairedThroughput runs b.N tasks on a plain asynq server and b.N on
// caughtup's at the same time, the caughtup side enqueued and started
// first if caughtupFirst, and returns each side's tasks/s in the window
// where both were busy.
func pairedThroughput(b *testing.B, e *env, header string, caughtupFirst bool) (plainRate, caughtupRate float64, waitedTasks int64) {
	tasks := b.N
	var waited atomic.Int64 // caughtup's tasks that waited for a fresh observation

	// side is one server and the completion times of its tasks.
	type side struct {
		done  []int64
		n     atomic.Int64
		all   chan struct{}
		start func() error
		stop  func()
	}
	prepare := func(caughtup bool) *side {
		queue := queueName(b)
		sd := &side{done: make([]int64, tasks), all: make(chan struct{})}
		for i := range tasks {
			_, err := e.raw.Enqueue(asynq.NewTaskWithHeaders("bench", []byte(strconv.Itoa(i)), map[string]string{position.HeaderName: header}),
				asynq.Queue(queue))
			require.NoError(b, err)
		}
		// The same handler on both sides: the plain side finds no
		// decision, caughtup's a replica (after a wait for a fresh
		// observation when the loaded machine left the tracker stale).
		mux := asynq.NewServeMux()
		mux.HandleFunc("bench", func(ctx context.Context, task *asynq.Task) error {
			d, ok := consume.DecisionFrom(ctx)
			if ok != caughtup || caughtup && d.Outcome != consume.OutcomeReplica && d.Outcome != consume.OutcomeReplicaWaited {
				b.Errorf("routed %t, outcome %s; want routed %t to a replica", ok, d.Outcome, caughtup)
			}
			if d.Outcome == consume.OutcomeReplicaWaited {
				waited.Add(1)
			}
			if i := sd.n.Add(1); i <= int64(tasks) {
				sd.done[i-1] = time.Now().UnixNano()
				if i == int64(tasks) {
					close(sd.all)
				}
			}
			return nil
		})
		cfg := asynq.Config{Concurrency: 50, Queues: map[string]int{queue: 1}, LogLevel: asynq.ErrorLevel}
		if caughtup {
			srv, err := caughtupasynq.NewServer(e.opt, cfg, e.router, caughtupasynq.MiddlewareConfig{MeterProvider: e.mp, Logger: slog.New(slog.DiscardHandler)})
			require.NoError(b, err)
			sd.start, sd.stop = func() error { return srv.Start(mux) }, srv.Shutdown
		} else {
			// As ServerConfig sets them for the caughtup side.
			cfg.DelayedTaskCheckInterval = caughtupasynq.DelayedTaskCheckInterval
			cfg.TaskCheckInterval = caughtupasynq.TaskCheckInterval
			srv := asynq.NewServer(e.opt, cfg)
			sd.start, sd.stop = func() error { return srv.Start(mux) }, srv.Shutdown
		}
		return sd
	}
	wait := func(sd *side) {
		select {
		case <-sd.all:
		case <-time.After(5 * time.Minute):
			b.Fatalf("%d of %d tasks done after 5 minutes", sd.n.Load(), tasks)
		}
	}
	// rate is how many tasks per second sd completed in [from, to].
	rate := func(sd *side, from, to int64) float64 {
		n := 0
		for _, at := range sd.done {
			if at >= from && at <= to {
				n++
			}
		}
		return float64(n) / max(time.Duration(to-from), time.Microsecond).Seconds()
	}

	var p, w *side
	if caughtupFirst {
		w, p = prepare(true), prepare(false)
	} else {
		p, w = prepare(false), prepare(true)
	}
	first, second := p, w
	if caughtupFirst {
		first, second = w, p
	}
	runtime.GC()
	b.StartTimer()
	require.NoError(b, first.start())
	require.NoError(b, second.start())
	wait(p)
	wait(w)
	b.StopTimer()
	p.stop()
	w.stop()
	// The window where both were busy: from the later first task to the
	// earlier last one.
	from := max(slices.Min(p.done), slices.Min(w.done))
	to := min(slices.Max(p.done), slices.Max(w.done))
	return rate(p, from, to), rate(w, from, to), waited.Load()
}

// BenchmarkMiddleware is the middleware's own cost per task for a token a
// replica has replayed: header decoding, policy, Route (snapshot,
// Decide, metrics, context) and the call. Middleware's task carries no
// HeaderDedup (stamped by hand, enqueued by a plain client: one read of
// the primary's position per attempt); ClientStamped's is as Client
// stamps it. Routing's allocations are all ClientStamped makes.
func BenchmarkMiddleware(b *testing.B) {
	e := setup(b)
	ctx := e.write(b, ctxT(b), 1)
	require.NoError(b, e.cluster.WaitReplicasCaughtUp(ctx))
	tok, _ := enqueue.TokenFrom(ctx)
	task := asynq.NewTaskWithHeaders("bench", nil, map[string]string{position.HeaderName: encode(b, tok)})
	h := e.middleware(caughtupasynq.MiddlewareConfig{Policies: map[string]consume.Policy{"other:": consume.Always}})(
		asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error { return nil }))
	bg := context.Background()
	b.Run("Middleware", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := h.ProcessTask(bg, task); err != nil {
				b.Fatal(err)
			}
		}
	})
	// As Client stamps a task: HeaderDedup "0" spares the primary's
	// position that a task of unknown options is routed against.
	stamped := asynq.NewTaskWithHeaders("bench", nil, map[string]string{position.HeaderName: encode(b, tok), caughtupasynq.HeaderDedup: "0"})
	b.Run("ClientStamped", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := h.ProcessTask(bg, stamped); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("RouteAlone", func(b *testing.B) {
		header := task.Headers()[position.HeaderName]
		b.ReportAllocs()
		for b.Loop() {
			tok, decErr := position.DecodeHeaders(header)
			if _, _, err := e.router.Route(bg, consume.Job{Token: tok, TokenErr: decErr}); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// nopEnqueuer stands in for asynq's client, to measure stamping alone.
type nopEnqueuer struct{}

func (nopEnqueuer) EnqueueContext(context.Context, *asynq.Task, ...asynq.Option) (*asynq.TaskInfo, error) {
	return nil, nil
}

var taskSink *asynq.Task

// BenchmarkStamp is the producer's cost per task on top of asynq:
// NewTask (which records the options) and the Client's stamping, without
// Redis.
func BenchmarkStamp(b *testing.B) {
	tok := fakeToken(0x16B3740)
	ctx := enqueue.WithToken(context.Background(), tok)
	client := caughtupasynq.NewClient(nopEnqueuer{})
	payload := []byte(`{"user":42}`)
	b.Run("asynq.NewTask", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			taskSink = asynq.NewTask("email:send", payload, asynq.MaxRetry(5), asynq.Queue("mail"))
		}
	})
	b.Run("NewTask", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = caughtupasynq.NewTask(ctx, "email:send", payload, asynq.MaxRetry(5), asynq.Queue("mail"))
		}
	})
	b.Run("NewTask+EnqueueContext", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "email:send", payload, asynq.MaxRetry(5), asynq.Queue("mail"))); err != nil {
				b.Fatal(err)
			}
		}
	})
}
