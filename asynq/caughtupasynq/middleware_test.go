package caughtupasynq_test

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// run is one handler invocation as the test saw it.
type run struct {
	retried  int
	decision consume.Decision
	routed   bool
	val      string
	err      error
}

// recorder collects handler runs per task id.
type recorder struct {
	mu   sync.Mutex
	runs map[string][]run
	ch   chan string
}

func newRecorder() *recorder { return &recorder{runs: map[string][]run{}, ch: make(chan string, 1024)} }

func (r *recorder) add(ctx context.Context, rn run) {
	id, _ := asynq.GetTaskID(ctx)
	rn.retried, _ = asynq.GetRetryCount(ctx)
	rn.decision, rn.routed = consume.DecisionFrom(ctx)
	r.mu.Lock()
	r.runs[id] = append(r.runs[id], rn)
	r.mu.Unlock()
	r.ch <- id
}

func (r *recorder) get(id string) []run {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]run(nil), r.runs[id]...)
}

// next waits for the next handler run.
func (r *recorder) next(t testing.TB, timeout time.Duration) string {
	t.Helper()
	select {
	case id := <-r.ch:
		return id
	case <-time.After(timeout):
		t.Fatalf("no handler ran within %v", timeout)
		return ""
	}
}

func replicaOf(d consume.Decision) string {
	dd, _ := d.Database("main")
	return dd.Replica
}

// wiring is how a test puts caughtup on an asynq server.
type wiring int

const (
	plainAsynq  wiring = iota // no caughtup at all
	oneCall                   // caughtupasynq.NewServer
	hooksAndMux               // caughtupasynq.ServerConfig + Middleware
)

func (w wiring) String() string {
	return [...]string{"PlainAsynq", "NewServer", "ServerConfig+Middleware"}[w]
}

// start serves h on the env's queue the way w wires caughtup, with mcfg
// for the middleware.
func (e *env) start(t testing.TB, w wiring, cfg asynq.Config, mcfg caughtupasynq.MiddlewareConfig, h asynq.Handler) (stop func()) {
	t.Helper()
	switch w {
	case oneCall:
		return e.server(t, cfg, mcfg, h)
	case hooksAndMux:
		return e.serve(t, caughtupasynq.ServerConfig(cfg), e.middleware(mcfg)(h))
	}
	return e.serve(t, cfg, h)
}

// TestHandlerErrorsRetryAsAsynq runs a failing handler with and without
// caughtup and requires the same retries: the count grows per attempt,
// the user's RetryDelayFunc and IsFailure see every error, and the task is
// archived after MaxRetry.
func TestHandlerErrorsRetryAsAsynq(t *testing.T) {
	e := setup(t)
	boom := errors.New("boom")

	type trace struct {
		retried []int
		delayNs []int
		failure int
		handled int
		state   asynq.TaskState
		final   int
	}
	scenario := func(t *testing.T, id int64, w wiring) trace {
		var (
			mu sync.Mutex
			tr trace
		)
		attempts := make(chan struct{}, 8)
		cfg := asynq.Config{
			RetryDelayFunc: func(n int, err error, task *asynq.Task) time.Duration {
				mu.Lock()
				defer mu.Unlock()
				if errors.Is(err, boom) {
					tr.delayNs = append(tr.delayNs, n)
				}
				return 0
			},
			IsFailure: func(err error) bool {
				mu.Lock()
				defer mu.Unlock()
				tr.failure++
				return true
			},
			ErrorHandler: asynq.ErrorHandlerFunc(func(ctx context.Context, task *asynq.Task, err error) {
				mu.Lock()
				defer mu.Unlock()
				tr.handled++
			}),
		}
		h := asynq.Handler(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			n, _ := asynq.GetRetryCount(ctx)
			if w != plainAsynq {
				if _, err := read(ctx, id); err != nil {
					return err
				}
			}
			mu.Lock()
			tr.retried = append(tr.retried, n)
			mu.Unlock()
			attempts <- struct{}{}
			return boom
		}))
		ctx := e.write(t, ctxT(t), id)
		stop := e.start(t, w, cfg, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed}, h)
		defer stop()
		info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "fail", nil, asynq.MaxRetry(2), asynq.Queue(e.queue)))
		require.NoError(t, err)
		for range 3 {
			select {
			case <-attempts:
			case <-time.After(30 * time.Second):
				t.Fatal("attempt did not run")
			}
		}
		waitFor(t, 30*time.Second, func() bool {
			got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
			return err == nil && got.State == asynq.TaskStateArchived
		}, "the task was not archived after MaxRetry")
		got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
		require.NoError(t, err)
		mu.Lock()
		defer mu.Unlock()
		tr.state, tr.final = got.State, got.Retried
		return tr
	}
	plain := scenario(t, 1, plainAsynq)
	require.Equal(t, trace{retried: []int{0, 1, 2}, delayNs: []int{0, 1}, failure: 2, handled: 3, state: asynq.TaskStateArchived, final: 2}, plain)
	for i, w := range []wiring{oneCall, hooksAndMux} {
		require.Equal(t, plain, scenario(t, int64(2+i), w), "%s changed how asynq retries handler errors", w)
	}
}

// TestDeferralKeepsRetries pauses every replica: the task is deferred
// (not run, not counted as a failed attempt, not shown to the user's
// hooks) and runs on a replica once replay resumes, with either wiring;
// the middleware finds no hook missing.
func TestDeferralKeepsRetries(t *testing.T) {
	for _, w := range []wiring{oneCall, hooksAndMux} {
		t.Run(w.String(), func(t *testing.T) {
			e := setup(t)
			var hooks sync.Map
			cfg := asynq.Config{
				RetryDelayFunc: func(n int, err error, task *asynq.Task) time.Duration {
					hooks.Store("RetryDelayFunc", err)
					return time.Second
				},
				IsFailure: func(err error) bool { hooks.Store("IsFailure", err); return true },
				ErrorHandler: asynq.ErrorHandlerFunc(func(ctx context.Context, task *asynq.Task, err error) {
					hooks.Store("ErrorHandler", err)
				}),
			}
			rec := newRecorder()
			e.start(t, w, cfg, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed}, asynq.HandlerFunc(
				func(ctx context.Context, task *asynq.Task) error {
					v, err := read(ctx, 1)
					rec.add(ctx, run{val: v, err: err})
					return err
				}))

			resume := e.pauseAll(t)
			ctx := e.write(t, ctxT(t), 1)
			info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "defer", nil, asynq.MaxRetry(1), asynq.Queue(e.queue)))
			require.NoError(t, err)

			deferred := map[string]string{"caughtup.outcome": consume.OutcomeDeferred.String()}
			waitFor(t, 30*time.Second, func() bool { return e.sum(t, "caughtup.consume.decisions", deferred) >= 2 },
				"the task was not deferred twice while replay was paused")
			got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
			require.NoError(t, err)
			require.Zero(t, got.Retried, "a deferral counted as a failed attempt")
			require.Contains(t, got.LastErr, "deferred")
			require.Empty(t, rec.get(info.ID), "the handler ran while every replica was paused")

			resume()
			require.Equal(t, info.ID, rec.next(t, 30*time.Second))
			runs := rec.get(info.ID)
			require.Len(t, runs, 1)
			require.NoError(t, runs[0].err)
			require.Equal(t, value(1), runs[0].val)
			require.Zero(t, runs[0].retried)
			require.NotEmpty(t, replicaOf(runs[0].decision), "outcome %s", runs[0].decision.Outcome)
			hooks.Range(func(k, v any) bool {
				t.Errorf("%s saw the deferral: %v", k, v)
				return true
			})
			require.Zero(t, e.sum(t, "caughtup.asynq.hooks.missing", nil), "the hooks were there")
		})
	}
}

// TestMissingHooksAreReported: Middleware without ServerConfig's hooks
// (or with one replaced) tells the newcomer, as an error log and a
// metric, when a task it deferred comes back.
func TestMissingHooksAreReported(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  func(asynq.Config) asynq.Config
		hook string
		// retried is the count the deferral left.
		retried int
	}{
		{"NoServerConfig", func(c asynq.Config) asynq.Config { return c }, "IsFailure", 1},
		{"RetryDelayFuncReplaced", func(c asynq.Config) asynq.Config {
			c = caughtupasynq.ServerConfig(c)
			c.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return time.Second }
			return c
		}, "RetryDelayFunc", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := setup(t)
			logs := newLogRecords(slog.LevelError)
			mw := e.middleware(caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed, Logger: slog.New(logs)})
			h, results := observe(mw(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
				_, err := read(ctx, 1)
				return err
			})))
			stop := e.serve(t, tc.cfg(asynq.Config{
				// So that the task comes back quickly without the hook.
				RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
			}), h)
			defer stop()
			resume := e.pauseAll(t)
			defer resume()
			ctx := e.write(t, ctxT(t), int64(len(tc.name)))
			info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "hooks", nil, asynq.MaxRetry(5), asynq.Queue(e.queue)))
			require.NoError(t, err)
			r := nextResult(t, results, 30*time.Second)
			require.Equal(t, info.ID, r.id)
			require.ErrorIs(t, r.err, consume.ErrDeferred)

			rec := logs.next(t, 30*time.Second) // when the task comes back
			require.Equal(t, slog.LevelError, rec.Level)
			require.Contains(t, rec.Message, "ServerConfig")
			var hook string
			rec.Attrs(func(a slog.Attr) bool {
				if a.Key == "caughtup.asynq.hook" {
					hook = a.Value.String()
				}
				return true
			})
			require.Equal(t, tc.hook, hook)
			require.Equal(t, int64(1), e.sum(t, "caughtup.asynq.hooks.missing", map[string]string{"caughtup.asynq.hook": tc.hook}))
			r = nextResult(t, results, 30*time.Second)
			require.Equal(t, info.ID, r.id)
			require.Equal(t, tc.retried, r.retried)
		})
	}
}

// TestLastAttemptNeverDefers: asynq archives a task that fails on its
// last attempt, so there a Delayed task that no replica served within its
// wait runs on the primary (Sticky) instead of being deferred.
func TestLastAttemptNeverDefers(t *testing.T) {
	e := setup(t)
	rec := newRecorder()
	mw := e.middleware(caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed})
	inner := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		v, err := read(ctx, mustAtoi(t, string(task.Payload())))
		rec.add(ctx, run{val: v, err: err})
		return err
	})
	boom := errors.New("boom")
	mux := asynq.NewServeMux()
	mux.Handle("zero", mw(inner))
	// "again" (not routed itself) fails its first attempt for real. Before
	// its second and last attempt the test pauses replay and writes row 3;
	// that attempt then runs, through the middleware and with asynq's
	// context, a task carrying row 3's token, which no replica has: it must
	// not be deferred.
	failed := make(chan struct{}, 1)
	tokens := make(chan position.Token, 1)
	mux.HandleFunc("again", func(ctx context.Context, task *asynq.Task) error {
		if n, _ := asynq.GetRetryCount(ctx); n == 0 {
			failed <- struct{}{}
			return boom
		}
		var tok position.Token
		select {
		case tok = <-tokens:
		case <-ctx.Done():
			return ctx.Err()
		}
		text, err := tok.Encode()
		if err != nil {
			return err
		}
		return mw(inner).ProcessTask(ctx, asynq.NewTaskWithHeaders("again", []byte("3"), map[string]string{position.HeaderName: text}))
	})
	e.serve(t, caughtupasynq.ServerConfig(asynq.Config{
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 0 },
	}), mux)

	lastAttempt := map[string]string{"caughtup.asynq.override": "last_attempt"}
	t.Run("MaxRetryZero", func(t *testing.T) {
		resume := e.pauseAll(t)
		defer resume()
		ctx := e.write(t, ctxT(t), 2)
		info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "zero", []byte("2"), asynq.MaxRetry(0), asynq.Queue(e.queue)))
		require.NoError(t, err)
		require.Equal(t, info.ID, rec.next(t, 30*time.Second))
		runs := rec.get(info.ID)
		require.NoError(t, runs[0].err)
		require.Equal(t, value(2), runs[0].val)
		require.Equal(t, consume.OutcomePrimary, runs[0].decision.Outcome)
		require.Equal(t, consume.ReasonCannotDefer, runs[0].decision.Reason)
		require.Equal(t, consume.Delayed, runs[0].decision.Policy, "routed once, with its own policy")
		require.Equal(t, int64(1), e.sum(t, "caughtup.asynq.overrides", lastAttempt))
		require.Zero(t, e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": consume.OutcomeDeferred.String()}),
			"no deferral decided, none counted")
		require.Equal(t, int64(1), e.sum(t, "caughtup.consume.fallback.budget", map[string]string{"caughtup.budget": "local", "caughtup.result": "allowed"}),
			"the primary read was charged to the cap")
		require.GreaterOrEqual(t, runs[0].decision.Waited, time.Duration(0))
		waitFor(t, 10*time.Second, func() bool {
			_, err := e.inspector.GetTaskInfo(e.queue, info.ID)
			return errors.Is(err, asynq.ErrTaskNotFound)
		}, "the task did not complete")
	})
	t.Run("AfterHandlerErrors", func(t *testing.T) {
		ctx := e.write(t, ctxT(t), 1)
		_, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "again", nil, asynq.MaxRetry(1), asynq.Queue(e.queue)))
		require.NoError(t, err)
		select {
		case <-failed:
		case <-time.After(30 * time.Second):
			t.Fatal("the first attempt did not run")
		}
		resume := e.pauseAll(t)
		defer resume()
		tok, _ := enqueue.TokenFrom(e.write(t, ctxT(t), 3))
		tokens <- tok
		id := rec.next(t, 30*time.Second)
		runs := rec.get(id)
		require.Len(t, runs, 1)
		require.NoError(t, runs[0].err)
		require.Equal(t, value(3), runs[0].val)
		require.Equal(t, 1, runs[0].retried)
		require.Equal(t, consume.OutcomePrimary, runs[0].decision.Outcome)
		require.Equal(t, int64(2), e.sum(t, "caughtup.asynq.overrides", lastAttempt))
	})
}

func mustAtoi(t testing.TB, s string) int64 {
	n, err := strconv.ParseInt(s, 10, 64)
	require.NoError(t, err)
	return n
}

// TestCapOnLastAttemptHolds: a refusal by the fallback cap counts as a
// failed attempt; on the last one the task, which any error would
// archive, is held in its worker while the cap is spent, never reads the
// primary uncharged, and runs on a replica once one catches up.
func TestCapOnLastAttemptHolds(t *testing.T) {
	e := setup(t, func(c *consume.Config) {
		c.PrimaryRate = 1e-9 // the burst, then nothing
		c.PrimaryBurst = 1
	})
	rec := newRecorder()
	e.serve(t, caughtupasynq.ServerConfig(asynq.Config{}), e.middleware(caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Sticky})(
		asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			v, err := read(ctx, mustAtoi(t, string(task.Payload())))
			rec.add(ctx, run{val: v, err: err})
			return err
		})))
	resume := e.pauseAll(t)
	defer resume()

	enq := func(id int64, maxRetry int) string {
		ctx := e.write(t, ctxT(t), id)
		info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "capped", []byte(strconv.FormatInt(id, 10)), asynq.MaxRetry(maxRetry), asynq.Queue(e.queue)))
		require.NoError(t, err)
		return info.ID
	}
	first := enq(1, 5)
	require.Equal(t, first, rec.next(t, 30*time.Second))
	require.Equal(t, consume.OutcomePrimary, rec.get(first)[0].decision.Outcome, "the burst lets one promotion through")

	second := enq(2, 1)
	capped := map[string]string{"caughtup.outcome": consume.OutcomeCapped.String()}
	waitFor(t, 30*time.Second, func() bool { return e.sum(t, "caughtup.consume.decisions", capped) == 1 },
		"the first attempt was not refused")
	// The second, last attempt is held: it neither runs nor fails.
	waitFor(t, 30*time.Second, func() bool {
		info, err := e.inspector.GetTaskInfo(e.queue, second)
		return err == nil && info.State == asynq.TaskStateActive && info.Retried == 1
	}, "the last attempt did not start")
	time.Sleep(2 * time.Second)
	require.Empty(t, rec.get(second), "the held task ran while every replica was paused and the cap was spent")
	require.Equal(t, int64(1), e.sum(t, "caughtup.consume.decisions", capped), "a held task is not refused again")

	resume()
	require.Equal(t, second, rec.next(t, 30*time.Second))
	runs := rec.get(second)
	require.Len(t, runs, 1)
	require.NoError(t, runs[0].err)
	require.Equal(t, value(2), runs[0].val)
	require.Equal(t, 1, runs[0].retried, "the refusal counted as an attempt")
	require.True(t, runs[0].decision.Held)
	require.NotEmpty(t, replicaOf(runs[0].decision), "it ran on the replica that caught up")
	require.Equal(t, int64(1), e.sum(t, "caughtup.asynq.overrides", map[string]string{"caughtup.asynq.override": "last_attempt"}))
	require.Equal(t, int64(1), e.sum(t, "caughtup.consume.fallback.budget", map[string]string{"caughtup.budget": "local", "caughtup.result": "allowed"}),
		"the only primary read is the burst's")
}

// TestBadHeadersReadPrimary: missing and broken token headers never fail a
// task; it reads the primary and the router counts it.
func TestBadHeadersReadPrimary(t *testing.T) {
	e := setup(t)
	rec := newRecorder()
	e.serve(t, caughtupasynq.ServerConfig(asynq.Config{}), e.middleware(caughtupasynq.MiddlewareConfig{})(
		asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			v, err := read(ctx, 1)
			rec.add(ctx, run{val: v, err: err})
			return err
		})))
	e.write(t, ctxT(t), 1)
	headers := []map[string]string{
		nil,
		{},
		{position.HeaderName: ""},
		{position.HeaderName: "garbage"},
		{position.HeaderName: "v9;0;main=p.1.1.0/1"},
		{position.HeaderName: "v1;0;main=p.1.1.not-an-lsn"},
		{position.HeaderName: string(make([]byte, 4096))},
		{caughtupasynq.HeaderDedup: "1", position.HeaderName: "garbage"},
	}
	ids := map[string]bool{}
	for i, h := range headers {
		info, err := e.raw.Enqueue(asynq.NewTaskWithHeaders("bad", []byte(strconv.Itoa(i)), h), asynq.Queue(e.queue), asynq.MaxRetry(0))
		require.NoError(t, err)
		ids[info.ID] = true
	}
	for range headers {
		id := rec.next(t, 30*time.Second)
		require.True(t, ids[id])
		runs := rec.get(id)
		require.Len(t, runs, 1)
		require.NoError(t, runs[0].err)
		require.Equal(t, value(1), runs[0].val)
		require.Equal(t, consume.OutcomePrimaryNoToken, runs[0].decision.Outcome)
		require.Empty(t, replicaOf(runs[0].decision))
	}
	require.Equal(t, int64(3), e.sum(t, "caughtup.consume.tokens.missing", map[string]string{"caughtup.reason": consume.ReasonNoToken.String()}))
	require.Equal(t, int64(len(headers)-3), e.sum(t, "caughtup.consume.tokens.missing", map[string]string{"caughtup.reason": consume.ReasonMalformedToken.String()}))
}

// TestPoliciesPerTaskType calls the middleware directly (no server): the
// policy follows the task type as asynq.ServeMux matches patterns.
func TestPoliciesPerTaskType(t *testing.T) {
	e := setup(t)
	ctx := e.write(t, ctxT(t), 1)
	require.NoError(t, e.cluster.WaitReplicasCaughtUp(ctx))
	tok, _ := enqueue.TokenFrom(ctx)
	// The replicas have the write; the router must have seen it too, or
	// a sticky task that comes first (map order) goes to the primary.
	require.NoError(t, e.router.WaitCaughtUp(ctx, tok))
	mw := e.middleware(caughtupasynq.MiddlewareConfig{
		Policies: map[string]consume.Policy{"report:": consume.Always, "email:": consume.Sticky, "email:digest": consume.Delayed},
	})
	var got consume.Decision
	h := mw(asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		got, _ = consume.DecisionFrom(ctx)
		_, err := read(ctx, 1)
		return err
	}))
	for typ, want := range map[string]consume.Policy{
		"report:daily":  consume.Always,
		"email:welcome": consume.Sticky,
		"email:digest":  consume.Delayed,
		"other":         consume.Delayed, // the router's default
	} {
		task := asynq.NewTaskWithHeaders(typ, nil, map[string]string{position.HeaderName: encode(t, tok)})
		require.NoError(t, h.ProcessTask(context.Background(), task))
		require.Equal(t, want, got.Policy, typ)
		if want == consume.Always {
			require.Equal(t, consume.OutcomePrimary, got.Outcome)
		} else {
			require.Equal(t, consume.OutcomeReplica, got.Outcome, typ)
		}
	}
	require.NoError(t, h.ProcessTask(context.Background(), asynq.NewTask("other", nil)))
	require.Equal(t, consume.OutcomePrimaryNoToken, got.Outcome)
	require.Equal(t, int64(1), e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": consume.OutcomePrimaryNoToken.String()}))
}

// TestDuplicateSeesLaterWrite: a deduplicated task already queued stands
// for a duplicate that asynq rejects; the duplicate's write must be
// visible to the task, whichever way the task was enqueued: through
// Client with asynq.Unique given to NewTask, or through a plain
// *asynq.Client with asynq.Unique or asynq.TaskID given to its Enqueue,
// whose options caughtup cannot see. Without the dedup rule the task
// would run on a replica that has the first write but not the second
// (the control task shows that such a replica exists during the test).
func TestDuplicateSeesLaterWrite(t *testing.T) {
	for _, tc := range []struct {
		name    string
		enqueue func(e *env, ctx context.Context) (*asynq.TaskInfo, error)
		dupErr  error
	}{
		{"ClientUnique", func(e *env, ctx context.Context) (*asynq.TaskInfo, error) {
			return e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "sync:user", []byte("1"), asynq.Unique(time.Minute), asynq.Queue(e.queue)))
		}, asynq.ErrDuplicateTask},
		{"PlainClientUnique", func(e *env, ctx context.Context) (*asynq.TaskInfo, error) {
			return e.raw.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "sync:user", []byte("1")), asynq.Unique(time.Minute), asynq.Queue(e.queue))
		}, asynq.ErrDuplicateTask},
		{"PlainClientTaskID", func(e *env, ctx context.Context) (*asynq.TaskInfo, error) {
			return e.raw.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "sync:user", []byte("1")), asynq.TaskID("user-1"), asynq.Queue(e.queue))
		}, asynq.ErrTaskIDConflict},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := setup(t)
			ctx := ctxT(t)
			ctx1 := e.write(t, ctx, 1)
			info, err := tc.enqueue(e, ctx1)
			require.NoError(t, err)
			tok1, _ := enqueue.TokenFrom(ctx1)
			_, err = e.raw.Enqueue(asynq.NewTaskWithHeaders("sync:control", []byte("1"), map[string]string{
				position.HeaderName: encode(t, tok1), caughtupasynq.HeaderDedup: "0"}), asynq.Queue(e.queue))
			require.NoError(t, err)
			require.NoError(t, e.cluster.WaitReplicasCaughtUp(ctx))
			resume := e.pauseAll(t)
			defer resume()

			// The second write, and its enqueue, which asynq rejects.
			ctx2, err := enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `UPDATE items SET val = 'second' WHERE id = 1`)
				return err
			})
			require.NoError(t, err)
			_, err = tc.enqueue(e, ctx2)
			require.ErrorIs(t, err, tc.dupErr)

			rec := newRecorder()
			e.serve(t, caughtupasynq.ServerConfig(asynq.Config{}), e.middleware(caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed})(
				asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
					v, err := read(ctx, 1)
					rec.add(ctx, run{val: v, err: err})
					return err
				})))

			control := rec.next(t, 30*time.Second)
			require.NotEqual(t, info.ID, control)
			runs := rec.get(control)
			require.Equal(t, value(1), runs[0].val, "the control task read a replica without the second write")
			require.NotEmpty(t, replicaOf(runs[0].decision))

			deferred := map[string]string{"caughtup.outcome": consume.OutcomeDeferred.String()}
			waitFor(t, 30*time.Second, func() bool { return e.sum(t, "caughtup.consume.decisions", deferred) >= 1 },
				"the task was not deferred while no replica had the duplicate's write")
			require.Empty(t, rec.get(info.ID), "the task ran while no replica had the duplicate's write")
			resume()
			require.Equal(t, info.ID, rec.next(t, 30*time.Second))
			runs = rec.get(info.ID)
			require.NoError(t, runs[0].err)
			require.Equal(t, "second", runs[0].val, "the task missed the duplicate's write")
			require.NotEmpty(t, replicaOf(runs[0].decision), "it still reads a replica once one caught up")
			require.Zero(t, runs[0].retried)
		})
	}
}

// TestDuplicateOfActiveTaskMissesLaterWrite pins what Client's doc says of
// a duplicate rejected while the task is active: that run started before
// the write and does not see it (asynq alone would not either), so the
// caller must enqueue again once it is done.
func TestDuplicateOfActiveTaskMissesLaterWrite(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t)
	started, release := make(chan struct{}), make(chan struct{})
	rec := newRecorder()
	e.serve(t, caughtupasynq.ServerConfig(asynq.Config{}), e.middleware(caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed})(
		asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			v, err := read(ctx, 1)
			close(started)
			<-release
			rec.add(ctx, run{val: v, err: err})
			return err
		})))
	ctx1 := e.write(t, ctx, 1)
	task := func(ctx context.Context) *asynq.Task {
		return caughtupasynq.NewTask(ctx, "sync:user", []byte("1"), asynq.TaskID("active-1"), asynq.Queue(e.queue))
	}
	info, err := e.client.EnqueueContext(ctx1, task(ctx1))
	require.NoError(t, err)
	<-started
	ctx2, err := enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE items SET val = 'second' WHERE id = 1`)
		return err
	})
	require.NoError(t, err)
	_, err = e.client.EnqueueContext(ctx2, task(ctx2))
	require.ErrorIs(t, err, asynq.ErrTaskIDConflict)
	got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateActive, got.State, "the conflict is with a task already running")
	close(release)
	require.Equal(t, info.ID, rec.next(t, 30*time.Second))
	require.Equal(t, value(1), rec.get(info.ID)[0].val, "the active run read before the write")
}

// TestHandlerEnqueueCarriesFurthestPosition: a task enqueued from a
// handler, or the handler's own task enqueued again, carries at least the
// job's token and what the replica it read had replayed. The handler's
// task goes again with the enqueue's options only, as through asynq's own
// Client: asynq hands handlers tasks without options (the raw re-enqueue
// pins that, so an asynq upgrade that changed it fails here).
func TestHandlerEnqueueCarriesFurthestPosition(t *testing.T) {
	e := setup(t)
	ctx := e.write(t, ctxT(t), 1)
	parentTok, _ := enqueue.TokenFrom(ctx)
	childQueue := e.queue + "_child" // not served: the children stay for inspection
	type result struct {
		decision            consume.Decision
		child, again, raw   string
		headerBefore, after string
	}
	results := make(chan result, 1)
	e.server(t, asynq.Config{}, caughtupasynq.MiddlewareConfig{}, asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		if _, err := read(ctx, 1); err != nil {
			return err
		}
		r := result{headerBefore: task.Headers()[position.HeaderName]}
		r.decision, _ = consume.DecisionFrom(ctx)
		info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "child", nil, asynq.Queue(childQueue)))
		if err != nil {
			return err
		}
		r.child = info.ID
		if info, err = e.client.EnqueueContext(ctx, task, asynq.Queue(childQueue)); err != nil {
			return err
		}
		r.again = info.ID
		if info, err = e.raw.EnqueueContext(ctx, task, asynq.Queue(childQueue)); err != nil {
			return err
		}
		r.raw = info.ID
		r.after = task.Headers()[position.HeaderName]
		select {
		case results <- r:
		default:
		}
		return nil
	}))
	_, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "parent", nil,
		asynq.Queue(e.queue), asynq.MaxRetry(3), asynq.Timeout(time.Minute), asynq.Deadline(time.Now().Add(time.Hour))))
	require.NoError(t, err)
	var r result
	select {
	case r = <-results:
	case <-time.After(30 * time.Second):
		t.Fatal("the parent did not run")
	}
	require.Equal(t, r.headerBefore, r.after, "the handler's task was modified")
	want, _ := parentTok.Entry("main")
	dd, _ := r.decision.Database("main")
	for _, id := range []string{r.child, r.again} {
		info, err := e.inspector.GetTaskInfo(childQueue, id)
		require.NoError(t, err)
		tok, err := position.Decode(info.Headers[position.HeaderName])
		require.NoError(t, err)
		got, ok := tok.Entry("main")
		require.True(t, ok)
		require.GreaterOrEqual(t, got.LSN, want.LSN, "behind the parent's token")
		require.GreaterOrEqual(t, got.LSN, dd.ReadAt.LSN, "behind what the parent read")
		require.Equal(t, "0", info.Headers[caughtupasynq.HeaderDeadline], "the deadline of the options it goes with")
	}
	raw, err := e.inspector.GetTaskInfo(childQueue, r.raw)
	require.NoError(t, err)
	again, err := e.inspector.GetTaskInfo(childQueue, r.again)
	require.NoError(t, err)
	for _, info := range []*asynq.TaskInfo{raw, again} {
		require.Equal(t, 25, info.MaxRetry, "asynq's default: the handler's task carries no options")
		require.Equal(t, 30*time.Minute, info.Timeout)
		require.True(t, info.Deadline.IsZero())
	}
	require.NoError(t, e.inspector.DeleteQueue(childQueue, true))
}

// TestDeferralEndsAtMaxAge: deferral is bounded by the token's age; past
// the router's MaxAge the task reads the primary, still without a failed
// attempt.
func TestDeferralEndsAtMaxAge(t *testing.T) {
	e := setup(t, func(c *consume.Config) { c.MaxAge = 2500 * time.Millisecond })
	rec := newRecorder()
	e.serve(t, caughtupasynq.ServerConfig(asynq.Config{}), e.middleware(caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed})(
		asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			v, err := read(ctx, 1)
			rec.add(ctx, run{val: v, err: err})
			return err
		})))
	resume := e.pauseAll(t)
	defer resume()
	ctx := e.write(t, ctxT(t), 1)
	info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "maxage", nil, asynq.MaxRetry(3), asynq.Queue(e.queue)))
	require.NoError(t, err)
	require.Equal(t, info.ID, rec.next(t, 30*time.Second))
	runs := rec.get(info.ID)
	require.NoError(t, runs[0].err)
	require.Equal(t, value(1), runs[0].val)
	require.Zero(t, runs[0].retried, "deferrals counted as failed attempts")
	require.Equal(t, consume.OutcomePrimary, runs[0].decision.Outcome)
	require.Equal(t, consume.ReasonDeadline, runs[0].decision.Reason)
	require.GreaterOrEqual(t, e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": consume.OutcomeDeferred.String()}), int64(1))
	require.Zero(t, e.sum(t, "caughtup.asynq.overrides", nil))
}
