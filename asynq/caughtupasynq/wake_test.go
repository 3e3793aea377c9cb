package caughtupasynq_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/testkit/metrictest"
)

// slowDeferrals makes every deferral a minute long, so that a task that
// runs within the tests' 30s deadlines after replay resumed can only have
// been woken: its delay had not ended.
func slowDeferrals(c *consume.Config) {
	c.WaitBudget = 100 * time.Millisecond
	c.DeferInitial = time.Minute
	c.DeferMax = time.Minute
	c.MaxAge = 10 * time.Minute
}

// start is one handler run as a wake test sees it.
type start struct {
	id      string
	at      time.Time
	retried int
	dec     consume.Decision
	val     string
	err     error
}

// starts is a handler that reads the row its payload names where the
// router sent it (when routed) and reports every run.
func starts() (asynq.Handler, <-chan start) {
	ch := make(chan start, 64)
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		s := start{at: time.Now()}
		s.id, _ = asynq.GetTaskID(ctx)
		s.retried, _ = asynq.GetRetryCount(ctx)
		var routed bool
		if s.dec, routed = consume.DecisionFrom(ctx); routed {
			id, _ := strconv.ParseInt(string(task.Payload()), 10, 64)
			s.val, s.err = read(ctx, id)
		}
		ch <- s
		return s.err
	}), ch
}

func nextStart(t testing.TB, ch <-chan start, timeout time.Duration, what string) start {
	t.Helper()
	select {
	case s := <-ch:
		return s
	case <-time.After(timeout):
		t.Fatalf("%s: no handler started within %v", what, timeout)
		return start{}
	}
}

// remembered is the sum of caughtup.asynq.wake.remembered.
func (e *env) remembered(t testing.TB) int64 {
	t.Helper()
	return metrictest.Sum(t, e.reader, "caughtup.asynq.wake.remembered")
}

func (e *env) wakeErrors(t testing.TB, errorType string) int64 {
	return e.sum(t, "caughtup.asynq.wake.errors", map[string]string{"error.type": errorType})
}

// deferOne writes row id, enqueues a task that reads it while every
// replica is paused, and waits until asynq holds it in the retry set,
// deferred without a failed attempt. It returns the task's state then.
func (e *env) deferOne(t testing.TB, id int64, opts ...asynq.Option) *asynq.TaskInfo {
	t.Helper()
	ctx := e.write(t, ctxT(t), id)
	task := caughtupasynq.NewTask(ctx, "wake", []byte(strconv.FormatInt(id, 10)), append([]asynq.Option{asynq.MaxRetry(3), asynq.Queue(e.queue)}, opts...)...)
	info, err := e.client.EnqueueContext(ctx, task)
	require.NoError(t, err)
	var got *asynq.TaskInfo
	waitFor(t, time.Minute, func() bool {
		got, err = e.inspector.GetTaskInfo(e.queue, info.ID)
		return err == nil && got.State == asynq.TaskStateRetry
	}, "task %d was not deferred", id)
	require.Zero(t, got.Retried, "a deferral counted as a failed attempt")
	require.Contains(t, got.LastErr, "deferred")
	return got
}

// TestWakeRunsDeferredTaskOnCatchUp: a task deferred for a minute while
// every replica is paused runs soon after replay resumes, before its delay
// ends, which only the wake explains; on a replica that has its row, with
// its retry count untouched, once. With NewServer, and with ServerConfig
// and Middleware given an Inspector or only the server's Redis.
func TestWakeRunsDeferredTaskOnCatchUp(t *testing.T) {
	for _, tc := range []struct {
		name string
		w    wiring
		mcfg func(*env, *caughtupasynq.MiddlewareConfig)
	}{
		{"NewServer", oneCall, func(*env, *caughtupasynq.MiddlewareConfig) {}},
		{"Inspector", hooksAndMux, func(e *env, c *caughtupasynq.MiddlewareConfig) { c.Inspector = e.inspector }},
		{"Redis", hooksAndMux, func(e *env, c *caughtupasynq.MiddlewareConfig) { c.Redis = e.opt }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := tc.w
			e := setup(t, slowDeferrals)
			h, runs := starts()
			var errs sync.Map
			cfg := asynq.Config{ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) { errs.Store(err.Error(), true) })}
			mcfg := caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed}
			tc.mcfg(e, &mcfg)
			e.start(t, w, cfg, mcfg, h)
			resume := e.pauseAll(t)

			info := e.deferOne(t, 1)
			require.Equal(t, int64(1), e.remembered(t))
			require.True(t, info.NextProcessAt.After(time.Now().Add(30*time.Second)), "the deferral's delay is a minute")
			require.Empty(t, runs, "ran while every replica was paused")

			resumed := time.Now()
			resume()
			s := nextStart(t, runs, 30*time.Second, "after the resume")
			require.Equal(t, info.ID, s.id)
			require.True(t, s.at.Before(info.NextProcessAt), "ran at %v, after its delay ended (%v): not woken", s.at, info.NextProcessAt)
			require.NoError(t, s.err)
			require.Equal(t, value(1), s.val)
			require.NotEmpty(t, replicaOf(s.dec), "outcome %s", s.dec.Outcome)
			require.Zero(t, s.retried, "retry count")
			t.Logf("resume → handler start %v", s.at.Sub(resumed))

			waitFor(t, 30*time.Second, func() bool { return e.remembered(t) == 0 }, "the woken task is still remembered")
			require.Equal(t, int64(1), e.sum(t, "caughtup.asynq.wake.tasks", nil))
			waitFor(t, 30*time.Second, func() bool {
				_, err := e.inspector.GetTaskInfo(e.queue, info.ID)
				return err != nil
			}, "the task was not completed")
			require.Empty(t, runs, "ran twice")
			errs.Range(func(k, _ any) bool { t.Errorf("error handler saw %v", k); return true })
		})
	}
}

// TestMiddlewareRefusesNoWake: Middleware with neither Redis nor an
// Inspector could not wake deferred tasks, which would then wait out
// their whole delay; it refuses at once, saying what to set, unless
// waking is turned off on purpose.
func TestMiddlewareRefusesNoWake(t *testing.T) {
	t.Parallel()
	e := setup(t)
	require.PanicsWithError(t, caughtupasynq.MiddlewareConfig{}.Validate().Error(), func() {
		caughtupasynq.Middleware(e.router, caughtupasynq.MiddlewareConfig{})
	})
	err := caughtupasynq.MiddlewareConfig{}.Validate()
	require.ErrorIs(t, err, caughtupasynq.ErrInvalidConfig)
	require.ErrorContains(t, err, "MiddlewareConfig.Redis")
	require.NotPanics(t, func() { caughtupasynq.Middleware(e.router, caughtupasynq.MiddlewareConfig{WakeCapacity: -1}) })
	require.NotPanics(t, func() { caughtupasynq.Middleware(e.router, caughtupasynq.MiddlewareConfig{Redis: e.opt}) })
}

// TestWakeRaces: the remembered task is no longer in the retry set when
// its token catches up. Nothing runs twice, no error reaches a handler
// or an ErrorHandler, and the task is forgotten.
func TestWakeRaces(t *testing.T) {
	// other starts a plain asynq server on the env's queue: another worker
	// process. Only the caughtup server stops pulling tasks first.
	type fixture struct {
		e       *env
		info    *asynq.TaskInfo
		resume  func()
		stopA   func()
		runsA   <-chan start
		errs    *sync.Map
		errorsH asynq.ErrorHandler
	}
	setupRace := func(t *testing.T, opts ...asynq.Option) *fixture {
		f := &fixture{e: setup(t, slowDeferrals), errs: &sync.Map{}}
		f.errorsH = asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) { f.errs.Store(err.Error(), true) })
		var h asynq.Handler
		h, f.runsA = starts()
		srv, err := caughtupasynq.NewServer(f.e.opt, f.e.serverConfig(asynq.Config{ErrorHandler: f.errorsH}), f.e.router,
			caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed, MeterProvider: f.e.mp})
		require.NoError(t, err)
		require.NoError(t, srv.Start(h))
		t.Cleanup(srv.Shutdown)
		f.stopA = srv.Stop
		f.resume = f.e.pauseAll(t)
		f.info = f.e.deferOne(t, 1, opts...)
		require.Equal(t, int64(1), f.e.remembered(t))
		f.stopA() // server A pulls no more tasks; its middleware still wakes
		return f
	}
	noErrors := func(t *testing.T, f *fixture) {
		f.errs.Range(func(k, _ any) bool { t.Errorf("an error handler saw %v", k); return true })
		require.Empty(t, f.runsA, "the deferring server ran the task again")
		require.Zero(t, f.e.sum(t, "caughtup.asynq.wake.tasks", nil), "a task not in the retry set was woken")
		waitFor(t, 30*time.Second, func() bool { return f.e.remembered(t) == 0 }, "the task is still remembered")
	}

	t.Run("Deleted", func(t *testing.T) {
		f := setupRace(t)
		require.NoError(t, f.e.inspector.DeleteTask(f.e.queue, f.info.ID))
		f.resume()
		waitFor(t, 30*time.Second, func() bool { return f.e.wakeErrors(t, "not_found") == 1 }, "the wake did not find the task gone")
		noErrors(t, f)
	})

	t.Run("CompletedElsewhere", func(t *testing.T) {
		// Kept as completed (Retention): RunTask would run it again.
		f := setupRace(t, asynq.Retention(time.Hour))
		hB, runsB := starts()
		f.e.serve(t, asynq.Config{ErrorHandler: f.errorsH}, hB)
		require.NoError(t, f.e.inspector.RunTask(f.e.queue, f.info.ID)) // another worker runs it (unrouted) and completes it
		require.Equal(t, f.info.ID, nextStart(t, runsB, 30*time.Second, "the other worker").id)
		waitFor(t, 30*time.Second, func() bool {
			got, err := f.e.inspector.GetTaskInfo(f.e.queue, f.info.ID)
			return err == nil && got.State == asynq.TaskStateCompleted
		}, "the task was not completed")
		f.resume()
		waitFor(t, 30*time.Second, func() bool { return f.e.wakeErrors(t, "finished") == 1 }, "the wake did not find the task finished")
		got, err := f.e.inspector.GetTaskInfo(f.e.queue, f.info.ID)
		require.NoError(t, err)
		require.Equal(t, asynq.TaskStateCompleted, got.State, "the completed task was moved")
		require.Empty(t, runsB, "the completed task ran again")
		noErrors(t, f)
	})

	t.Run("RunningElsewhere", func(t *testing.T) {
		f := setupRace(t)
		release := make(chan struct{})
		hB, runsB := starts()
		f.e.serve(t, asynq.Config{ErrorHandler: f.errorsH}, asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			err := hB.ProcessTask(ctx, task)
			<-release
			return err
		}))
		require.NoError(t, f.e.inspector.RunTask(f.e.queue, f.info.ID))
		require.Equal(t, f.info.ID, nextStart(t, runsB, 30*time.Second, "the other worker").id)
		// The other worker is inside the handler when the token catches
		// up: the wake finds the task active and tries again later.
		f.resume()
		waitFor(t, 30*time.Second, func() bool { return f.e.wakeErrors(t, "active") >= 1 }, "the wake did not find the task running")
		close(release)
		waitFor(t, 30*time.Second, func() bool { return f.e.wakeErrors(t, "not_found") == 1 }, "the wake did not find the finished task gone")
		require.Empty(t, runsB, "the task ran twice")
		noErrors(t, f)
	})
}

// TestWakeMemoryBound: with room for 3, five deferred tasks leave three
// remembered and two evicted; after the resume the three run at once and
// the two evicted wait in the retry set for their delay, which is the
// safety net.
func TestWakeMemoryBound(t *testing.T) {
	e := setup(t, slowDeferrals)
	h, runs := starts()
	e.server(t, asynq.Config{}, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed, WakeCapacity: 3}, h)
	resume := e.pauseAll(t)
	infos := map[string]*asynq.TaskInfo{}
	for id := int64(1); id <= 5; id++ {
		info := e.deferOne(t, id)
		infos[info.ID] = info
	}
	require.Equal(t, int64(3), e.remembered(t))
	require.Equal(t, int64(2), e.sum(t, "caughtup.asynq.wake.dropped", map[string]string{"caughtup.asynq.wake.reason": "evicted"}))

	resume()
	ran := map[string]bool{}
	for range 3 {
		s := nextStart(t, runs, 30*time.Second, "after the resume")
		require.NoError(t, s.err)
		require.True(t, s.at.Before(infos[s.id].NextProcessAt))
		ran[s.id] = true
	}
	waitFor(t, 30*time.Second, func() bool { return e.remembered(t) == 0 }, "woken tasks still remembered")
	require.Equal(t, int64(3), e.sum(t, "caughtup.asynq.wake.tasks", nil))
	for id := range infos {
		if ran[id] {
			continue
		}
		got, err := e.inspector.GetTaskInfo(e.queue, id)
		require.NoError(t, err)
		require.Equal(t, asynq.TaskStateRetry, got.State, "an evicted task waits for its delay")
		require.Zero(t, got.Retried)
	}
	require.Empty(t, runs)
}
