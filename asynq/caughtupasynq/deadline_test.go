package caughtupasynq_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// readingHandler reads the row its payload names and records the run.
func readingHandler(t testing.TB, rec *recorder) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		v, err := read(ctx, mustAtoi(t, string(task.Payload())))
		rec.add(ctx, run{val: v, err: err})
		return err
	})
}

func overrides(t testing.TB, e *env, o string) int64 {
	t.Helper()
	return e.sum(t, "caughtup.asynq.overrides", map[string]string{"caughtup.asynq.override": o})
}

// TestTimeoutDoesNotLimitDeferral is issue 12's scenario: replay paused on
// every replica, a fallback cap of 1 (burst 1), and Timeout(2s) and
// Timeout(30s) tasks whose tokens are 35s old, so that the router's
// deferral delay (30s) is longer than their timeouts. asynq gives every
// attempt a fresh Timeout, so they must be deferred like any other task:
// no primary read at all (not even the cap's one), no deadline override,
// no retry spent. Once replay resumes they run on a replica.
//
// With NewServer the middleware learns that the tasks have no
// asynq.Deadline from Redis, so tasks enqueued by a plain asynq client
// (no HeaderDeadline) defer too; with ServerConfig + Middleware it reads
// the HeaderDeadline that Client wrote.
func TestTimeoutDoesNotLimitDeferral(t *testing.T) {
	for _, w := range []wiring{oneCall, hooksAndMux} {
		t.Run(w.String(), func(t *testing.T) {
			e := setup(t, func(c *consume.Config) {
				c.PrimaryRate = 1e-9 // the burst, then nothing
				c.PrimaryBurst = 1
			})
			rec := newRecorder()
			e.start(t, w, asynq.Config{}, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed}, readingHandler(t, rec))
			resume := e.pauseAll(t)
			defer resume()

			ids := map[string]bool{}
			for i, timeout := range []time.Duration{2 * time.Second, 30 * time.Second, 2 * time.Second, 30 * time.Second, 2 * time.Second, 30 * time.Second, 2 * time.Second, 30 * time.Second, 2 * time.Second, 30 * time.Second} {
				id := int64(i + 1)
				tok, _ := enqueue.TokenFrom(e.write(t, ctxT(t), id))
				tok.CapturedAt = time.Now().Add(-35 * time.Second)
				payload := []byte(strconv.FormatInt(id, 10))
				opts := []asynq.Option{asynq.Timeout(timeout), asynq.MaxRetry(3), asynq.Queue(e.queue)}
				var info *asynq.TaskInfo
				var err error
				if w == oneCall && i%2 == 0 {
					// Stamped by hand and enqueued by asynq's own client:
					// no HeaderDeadline.
					info, err = e.raw.Enqueue(asynq.NewTaskWithHeaders("timeout", payload, map[string]string{position.HeaderName: encode(t, tok)}, opts...))
				} else {
					info, err = e.client.EnqueueToken(ctxT(t), tok, caughtupasynq.NewTask(context.Background(), "timeout", payload, opts...))
				}
				require.NoError(t, err)
				ids[info.ID] = true
			}

			deferred := map[string]string{"caughtup.outcome": consume.OutcomeDeferred.String()}
			waitFor(t, time.Minute, func() bool { return e.sum(t, "caughtup.consume.decisions", deferred) >= int64(len(ids)) },
				"the tasks were not deferred")
			for id := range ids {
				waitFor(t, 30*time.Second, func() bool {
					info, err := e.inspector.GetTaskInfo(e.queue, id)
					return len(rec.get(id)) > 0 || (err == nil && info.State == asynq.TaskStateRetry)
				}, "task %s was neither run nor scheduled again", id)
				require.Empty(t, rec.get(id), "task %s ran while every replica was paused (overrides: deadline %d, deadline_unknown %d)", id,
					overrides(t, e, "deadline"), overrides(t, e, "deadline_unknown"))
				info, err := e.inspector.GetTaskInfo(e.queue, id)
				require.NoError(t, err)
				require.Zero(t, info.Retried, "a deferral spent a retry")
			}
			for _, o := range []string{"deadline", "deadline_unknown"} {
				require.Zero(t, overrides(t, e, o), "override %s", o)
			}
			require.Zero(t, e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": consume.OutcomePrimary.String()}),
				"a primary read")

			// Caught up: run them now rather than after their 30s delay.
			// NewServer's middleware wakes them itself, so RunTask may find
			// one already gone from the retry set; either way each runs once.
			resume()
			for id := range ids {
				if err := e.inspector.RunTask(e.queue, id); err != nil {
					require.Equal(t, oneCall, w, "RunTask %s: %v", id, err)
				}
			}
			for range ids {
				id := rec.next(t, time.Minute)
				require.True(t, ids[id])
				runs := rec.get(id)
				require.Len(t, runs, 1)
				require.NoError(t, runs[0].err)
				require.NotEmpty(t, replicaOf(runs[0].decision), "outcome %s", runs[0].decision.Outcome)
				require.Zero(t, runs[0].retried)
			}
		})
	}
}

// TestDeadlineLimitsDeferral: a task with an asynq.Deadline nearer than
// the deferral's delay (5s here) runs now, on a caught-up replica or the
// primary, rather than being deferred past its deadline and archived,
// whichever way the middleware learns the deadline: from Redis
// (NewServer), from HeaderDeadline (Client), or, for a task without the
// header and a middleware without an Inspector, by assuming that its
// context's deadline is absolute.
func TestDeadlineLimitsDeferral(t *testing.T) {
	e := setup(t, func(c *consume.Config) { c.DeferInitial = 5 * time.Second })
	for _, tc := range []struct {
		name string
		w    wiring
		raw  bool // enqueued without HeaderDeadline
		opt  func() asynq.Option
		want string
	}{
		{"NewServer", oneCall, true, func() asynq.Option { return asynq.Deadline(time.Now().Add(5 * time.Second)) }, "deadline"},
		{"Header", hooksAndMux, false, func() asynq.Option { return asynq.Deadline(time.Now().Add(5 * time.Second)) }, "deadline"},
		{"Unknown", hooksAndMux, true, func() asynq.Option { return asynq.Timeout(5 * time.Second) }, "deadline_unknown"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := newRecorder()
			stop := e.start(t, tc.w, asynq.Config{}, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed}, readingHandler(t, rec))
			defer stop()
			resume := e.pauseAll(t)
			defer resume()
			id := int64(len(tc.name))
			ctx := e.write(t, ctxT(t), id)
			tok, _ := enqueue.TokenFrom(ctx)
			payload := []byte(strconv.FormatInt(id, 10))
			opts := []asynq.Option{tc.opt(), asynq.MaxRetry(5), asynq.Retention(time.Hour), asynq.Queue(e.queue)}
			before := overrides(t, e, tc.want)
			var info *asynq.TaskInfo
			var err error
			if tc.raw {
				info, err = e.raw.Enqueue(asynq.NewTaskWithHeaders("deadline", payload, map[string]string{position.HeaderName: encode(t, tok)}, opts...))
			} else {
				info, err = e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "deadline", payload, opts...))
			}
			require.NoError(t, err)
			require.Equal(t, info.ID, rec.next(t, 30*time.Second))
			runs := rec.get(info.ID)
			require.Len(t, runs, 1)
			require.NoError(t, runs[0].err)
			require.Equal(t, value(id), runs[0].val)
			require.Zero(t, runs[0].retried, "it ran on its first attempt")
			require.Equal(t, consume.OutcomePrimary, runs[0].decision.Outcome, "every replica is paused")
			require.Equal(t, before+1, overrides(t, e, tc.want))
			waitFor(t, 30*time.Second, func() bool {
				got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
				return err == nil && got.State == asynq.TaskStateCompleted
			}, "the task did not complete")
		})
	}
}

// TestGroupAggregatorCarriesGroupToken runs asynq's group aggregation
// through NewServer: the aggregated task, built by the user's
// GroupAggregator with NewTask, reaches its handler with the merged token
// of its group (so it reads a replica that has every member's write) and
// with its own options (MaxRetry 4), which asynq applies when it enqueues
// it.
func TestGroupAggregatorCarriesGroupToken(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx1, ctx2 := e.write(t, ctxT(t), 1), e.write(t, ctxT(t), 2)
	tok1, _ := enqueue.TokenFrom(ctx1)
	tok2, _ := enqueue.TokenFrom(ctx2)
	type seen struct {
		header   string
		maxRetry int
		decision consume.Decision
		vals     []string
		err      error
	}
	ch := make(chan seen, 1)
	cfg := asynq.Config{
		GroupGracePeriod: time.Second,
		GroupMaxSize:     2,
		GroupAggregator: asynq.GroupAggregatorFunc(func(group string, tasks []*asynq.Task) *asynq.Task {
			var payload []byte
			for i, t := range tasks {
				if i > 0 {
					payload = append(payload, ',')
				}
				payload = append(payload, t.Payload()...)
			}
			return caughtupasynq.NewTask(context.Background(), "batch", payload, asynq.MaxRetry(4))
		}),
	}
	e.server(t, cfg, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed}, asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		s := seen{header: task.Headers()[position.HeaderName]}
		s.maxRetry, _ = asynq.GetMaxRetry(ctx)
		s.decision, _ = consume.DecisionFrom(ctx)
		for _, id := range []int64{1, 2} {
			v, err := read(ctx, id)
			s.vals = append(s.vals, v)
			s.err = errors.Join(s.err, err)
		}
		select {
		case ch <- s:
		default:
		}
		return s.err
	}))
	for i, ctx := range []context.Context{ctx1, ctx2} {
		_, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "item", []byte(strconv.Itoa(i+1)), asynq.Group("g"), asynq.Queue(e.queue)))
		require.NoError(t, err)
	}
	var s seen
	select {
	case s = <-ch:
	case <-time.After(time.Minute):
		t.Fatal("the aggregated task did not run")
	}
	require.NoError(t, s.err)
	require.Equal(t, []string{value(1), value(2)}, s.vals)
	require.Equal(t, encode(t, tok1.Merge(tok2)), s.header)
	require.Equal(t, 4, s.maxRetry, "the aggregate kept its options")
	require.NotEqual(t, consume.OutcomePrimaryNoToken, s.decision.Outcome)
}
