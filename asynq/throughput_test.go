package asynq_test

import (
	"context"
	"log/slog"
	"slices"
	"sort"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	hasynq "github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	caughtupasynq "github.com/caughtup/caughtup/asynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// TestThroughput reports how many tasks per second a trivial handler
// completes with and without caughtup (ServerConfig + Middleware routing a
// caught-up token) against the shared redis-server. Each round runs two
// servers at once, one per side, on queues of the same size, and counts
// what each completed in the window where both were busy: load from
// elsewhere on the machine then hits both sides alike. It never asserts
// on wall-clock numbers; the ratio is for the report (target ≥ 0.97).
func TestThroughput(t *testing.T) {
	tasks, rounds := 3000, 5
	switch {
	case testing.Short():
		tasks, rounds = 500, 1
	case raceEnabled:
		tasks, rounds = 1500, 3
	}
	e := setup(t)
	ctx := e.write(t, ctxT(t), 1)
	require.NoError(t, e.cluster.WaitReplicasCaughtUp(ctx))
	tok, _ := enqueue.TokenFrom(ctx)
	header := encode(t, tok)

	// side is one server and the completion times of its tasks.
	type side struct {
		done []int64
		n    atomic.Int64
		all  chan struct{}
		srv  *hasynq.Server
		mux  *hasynq.ServeMux
	}
	prepare := func(caughtup bool) *side {
		queue := queueName(t)
		sd := &side{done: make([]int64, tasks), all: make(chan struct{}), mux: hasynq.NewServeMux()}
		for i := range tasks {
			_, err := e.raw.Enqueue(hasynq.NewTaskWithHeaders("bench", []byte(strconv.Itoa(i)), map[string]string{position.HeaderName: header}),
				hasynq.Queue(queue))
			require.NoError(t, err)
		}
		cfg := hasynq.Config{Concurrency: 50, Queues: map[string]int{queue: 1}, TaskCheckInterval: 10 * time.Millisecond, LogLevel: hasynq.ErrorLevel}
		if caughtup {
			sd.mux.Use(caughtupasynq.Middleware(e.router, caughtupasynq.MiddlewareConfig{MeterProvider: e.mp, Logger: slog.New(slog.DiscardHandler)}))
			cfg = caughtupasynq.ServerConfig(cfg)
		}
		sd.mux.HandleFunc("bench", func(ctx context.Context, task *hasynq.Task) error {
			if caughtup {
				if d, _ := consume.DecisionFrom(ctx); d.Outcome != consume.OutcomeReplica {
					t.Errorf("outcome %s, want replica", d.Outcome)
				}
			}
			if i := sd.n.Add(1); i <= int64(tasks) {
				sd.done[i-1] = time.Now().UnixNano()
				if i == int64(tasks) {
					close(sd.all)
				}
			}
			return nil
		})
		sd.srv = hasynq.NewServer(e.opt, cfg)
		return sd
	}
	wait := func(sd *side) {
		select {
		case <-sd.all:
		case <-time.After(2 * time.Minute):
			t.Fatalf("%d of %d tasks done after 2 minutes", sd.n.Load(), tasks)
		}
		sd.srv.Shutdown()
	}
	// rate is how many tasks per second sd completed in [from, to].
	rate := func(sd *side, from, to int64) float64 {
		n := 0
		for _, at := range sd.done {
			if at >= from && at <= to {
				n++
			}
		}
		return float64(n) / time.Duration(to-from).Seconds()
	}

	var plain, with, ratios []float64
	for i := range rounds {
		p, w := prepare(false), prepare(true)
		first, second := p, w
		if i%2 == 1 {
			first, second = w, p
		}
		require.NoError(t, first.srv.Start(first.mux))
		require.NoError(t, second.srv.Start(second.mux))
		wait(p)
		wait(w)
		// The window where both were busy: from the later first task to
		// the earlier last one.
		from := max(slices.Min(p.done), slices.Min(w.done))
		to := min(slices.Max(p.done), slices.Max(w.done))
		rp, rw := rate(p, from, to), rate(w, from, to)
		plain, with, ratios = append(plain, rp), append(with, rw), append(ratios, rw/rp)
	}
	if raceEnabled {
		t.Log("built with -race: the ratio understates the middleware's speed")
	}
	t.Logf("throughput, %d trivial tasks per side and round, concurrency 50, %d rounds, both sides at once: asynq %.0f tasks/s, with caughtup %.0f tasks/s, ratio %.3f (medians; ratios %.3f)",
		tasks, rounds, median(plain), median(with), median(ratios), ratios)
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// BenchmarkMiddleware is the middleware's own cost per task for a token a
// replica has replayed: header lookup, policy, Route (snapshot, Decide,
// metrics, context) and the call. Route's allocations are all it makes.
func BenchmarkMiddleware(b *testing.B) {
	e := setup(b)
	ctx := e.write(b, ctxT(b), 1)
	require.NoError(b, e.cluster.WaitReplicasCaughtUp(ctx))
	tok, _ := enqueue.TokenFrom(ctx)
	task := hasynq.NewTaskWithHeaders("bench", nil, map[string]string{position.HeaderName: encode(b, tok)})
	h := e.middleware(caughtupasynq.MiddlewareConfig{Policies: map[string]consume.Policy{"other:": consume.Always}})(
		hasynq.HandlerFunc(func(ctx context.Context, task *hasynq.Task) error { return nil }))
	bg := context.Background()
	b.Run("Middleware", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := h.ProcessTask(bg, task); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("RouteAlone", func(b *testing.B) {
		header := task.Headers()[position.HeaderName]
		b.ReportAllocs()
		for b.Loop() {
			if _, _, err := e.router.Route(bg, header, consume.PolicyDefault); err != nil {
				b.Fatal(err)
			}
		}
	})
}
