package caughtupasynq_test

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
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
	"github.com/caughtup/caughtup/testkit/latency"
)

// BenchmarkWakeLatency measures how soon deferred tasks run once replay
// resumes, with the wake (NewServer's default) and without it
// (WakeCapacity -1: the deferral delay alone). Per round: every replica's
// replay is paused, 200 tasks, each reading a row written just before, are
// enqueued over the first 2s (so that each waited its 500ms and was
// deferred, by 1s, 2s, …), replay resumes at 3s, and every task's handler
// start is recorded. It prints, per variant, p50/p99/max of
//
//   - resume → handler start, and
//   - catch-up → handler start: from the moment the tracker had read the
//     observation that first showed a replica past the task's token
//     (catchup.FirstCaughtUp over the snapshots a follower recorded,
//     CatchUp.Read) to the handler's start.
//
// Tasks that were waiting in Route (their WaitBudget) when replay resumed
// are reported apart: they were not deferred. Router defaults
// (PollInterval 100ms, WaitPollInterval 5ms, WaitBudget 500ms,
// DeferInitial 1s); asynq.Config{Concurrency: 250} (more workers than
// tasks, so that no task waits for one) through NewServer
// (TaskCheckInterval 20ms, DelayedTaskCheckInterval 1s). It asserts
// nothing about time. Run it alone:
//
//	go test -run '^$' -bench WakeLatency -benchtime 1x ./asynq/
func BenchmarkWakeLatency(b *testing.B) {
	e := setup(b, func(c *consume.Config) { c.Tracker.PollInterval = replay.DefaultPollInterval })
	type row struct {
		name                  string
		resume, catch, waited []time.Duration
		woken, primary        int64
		errs                  string
	}
	var rows []row
	round := 0
	for b.Loop() {
		rows = rows[:0]
		for _, wake := range []bool{true, false} {
			round++
			woken0 := e.sum(b, "caughtup.asynq.wake.tasks", nil)
			errs0 := map[string]int64{}
			for _, k := range wakeErrorTypes {
				errs0[k] = e.wakeErrors(b, k)
			}
			primary0 := e.sum(b, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": consume.OutcomePrimary.String()})
			r := wakeRound(b, e, wake, int64(round)*1000)
			name := "wake (NewServer)"
			if !wake {
				name = "no wake (WakeCapacity -1)"
			}
			rows = append(rows, row{name: name, resume: r.resume, catch: r.catch, waited: r.waited,
				woken:   e.sum(b, "caughtup.asynq.wake.tasks", nil) - woken0,
				primary: e.sum(b, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": consume.OutcomePrimary.String()}) - primary0})
			var errs []string
			for _, k := range wakeErrorTypes {
				if n := e.wakeErrors(b, k) - errs0[k]; n > 0 {
					errs = append(errs, fmt.Sprintf("%s %d", k, n))
				}
			}
			rows[len(rows)-1].errs = strings.Join(errs, ", ")
		}
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "\n| asynq, 200 tasks through a 3 s pause | deferred tasks | resume → start p50 | p99 | max | catch-up → start p50 | p99 | max | woken | not woken | primary | waiting in Route at resume: tasks | resume → start p50 | max |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, rw := range rows {
		fmt.Fprintf(&tb, "| %s | %d | %v | %v | %v | %v | %v | %v | %d | %s | %d | %d | %v | %v |\n", rw.name, len(rw.resume),
			pct(rw.resume, 0.5), pct(rw.resume, 0.99), pct(rw.resume, 1),
			pct(rw.catch, 0.5), pct(rw.catch, 0.99), pct(rw.catch, 1), rw.woken, rw.errs, rw.primary,
			len(rw.waited), pct(rw.waited, 0.5), pct(rw.waited, 1))
	}
	b.Log(tb.String())
	if len(rows) > 0 {
		b.ReportMetric(float64(pct(rows[0].catch, 0.99))/1e6, "catchup-start-p99-ms")
		b.ReportMetric(float64(pct(rows[0].resume, 0.99))/1e6, "resume-start-p99-ms")
	}
}

// pct is the p-th percentile of s, rounded to 0.1ms.
func pct(s []time.Duration, p float64) time.Duration {
	return latency.Percentile(s, p).Round(100 * time.Microsecond)
}

// wakeLatencies are the deferred tasks' latencies, and resume → start of
// the tasks that were waiting in Route (in their WaitBudget) when replay
// resumed.
type wakeLatencies struct{ resume, catch, waited []time.Duration }

// wakeRound runs one round of BenchmarkWakeLatency; row ids start past
// base.
func wakeRound(b *testing.B, e *env, wake bool, base int64) wakeLatencies {
	const tasks = 200
	ctx := context.Background()
	queue := queueName(b)
	var (
		mu     sync.Mutex
		starts = map[string]time.Time{}
		waited = map[string]bool{}
		all    = make(chan struct{})
	)
	mux := asynq.NewServeMux()
	mux.HandleFunc("wake", func(ctx context.Context, task *asynq.Task) error {
		at := time.Now()
		id, _ := asynq.GetTaskID(ctx)
		if _, err := read(ctx, mustAtoi(b, string(task.Payload()))); err != nil {
			return err
		}
		d, _ := consume.DecisionFrom(ctx)
		mu.Lock()
		defer mu.Unlock()
		if _, ok := starts[id]; !ok {
			starts[id] = at
			waited[id] = d.Outcome == consume.OutcomeReplicaWaited
			if len(starts) == tasks {
				close(all)
			}
		}
		return nil
	})
	mcfg := caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed, MeterProvider: e.mp, Logger: slog.New(slog.DiscardHandler)}
	if !wake {
		mcfg.WakeCapacity = -1
	}
	srv, err := caughtupasynq.NewServer(e.opt, asynq.Config{Concurrency: 250, Queues: map[string]int{queue: 1}, LogLevel: asynq.ErrorLevel}, e.router, mcfg)
	require.NoError(b, err)
	require.NoError(b, srv.Start(mux))
	defer srv.Shutdown()

	stopFollow := latency.Follow(e.router.Snapshot)
	for _, n := range e.cluster.Replicas() {
		require.NoError(b, n.PauseReplay(ctx))
	}
	paused := time.Now()
	toks := map[string]position.Token{}
	for i := range int64(tasks) {
		wctx := e.write(b, ctx, base+i)
		tok, _ := enqueue.TokenFrom(wctx)
		info, err := e.client.EnqueueContext(wctx, caughtupasynq.NewTask(wctx, "wake", []byte(strconv.FormatInt(base+i, 10)),
			asynq.Queue(queue), asynq.MaxRetry(5)))
		require.NoError(b, err)
		toks[info.ID] = tok
		time.Sleep(time.Until(paused.Add(time.Duration(i+1) * 2 * time.Second / tasks)))
	}
	time.Sleep(time.Until(paused.Add(3 * time.Second)))
	resumed := time.Now()
	for _, n := range e.cluster.Replicas() {
		require.NoError(b, n.ResumeReplay(ctx))
	}
	select {
	case <-all:
	case <-time.After(2 * time.Minute):
		b.Fatalf("not every task ran within 2 minutes of the resume")
	}
	recorded := stopFollow()
	cfg := e.router.Config()
	var out wakeLatencies
	mu.Lock()
	defer mu.Unlock()
	for id, at := range starts {
		if waited[id] {
			// Waiting in Route when replay resumed: not a deferral.
			out.waited = append(out.waited, at.Sub(resumed))
			continue
		}
		out.resume = append(out.resume, at.Sub(resumed))
		if caught, ok := catchup.FirstCaughtUp(toks[id], recorded, &cfg); ok {
			out.catch = append(out.catch, at.Sub(caught.Read))
		} else {
			b.Errorf("task %s: the recorded snapshots never show its token caught up", id)
		}
	}
	return out
}

// wakeErrorTypes are the values of error.type on caughtup.asynq.wake.errors
// (the package documentation lists them).
var wakeErrorTypes = []string{"not_found", "active", "pending", "finished", "changed", "raced", "redis"}
