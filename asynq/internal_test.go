package asynq

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	hasynq "github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

var epoch = position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}

func tokenAt(db string, lsn position.LSN, at time.Time) position.Token {
	return position.New(db, epoch, lsn, position.SourcePrimary, at)
}

func header(t *testing.T, tok position.Token) string {
	t.Helper()
	s, err := tok.Encode()
	require.NoError(t, err)
	return s
}

// TestTaskLayout fails when an asynq upgrade moves the options out of
// reach; stamping would then leave tasks unstamped (primary reads).
func TestTaskLayout(t *testing.T) {
	t.Parallel()
	require.True(t, optsOK, "asynq.Task no longer has opts []asynq.Option")
	in := []hasynq.Option{hasynq.Queue("q1"), hasynq.MaxRetry(3), hasynq.Timeout(time.Minute), hasynq.Unique(time.Hour)}
	got, ok := taskOptions(hasynq.NewTask("t", nil, in...))
	require.True(t, ok)
	require.Equal(t, in, got)
	got, ok = taskOptions(hasynq.NewTaskWithHeaders("t", nil, map[string]string{"a": "b"}, in[:2]...))
	require.True(t, ok)
	require.Equal(t, in[:2], got)
	got, ok = taskOptions(hasynq.NewTask("t", nil))
	require.True(t, ok)
	require.Empty(t, got)
}

func TestStamp(t *testing.T) {
	t.Parallel()
	now := time.UnixMilli(1_700_000_000_000)
	t1 := tokenAt("main", 0x1000, now)
	t2 := tokenAt("main", 0x2000, now.Add(time.Second))
	other := tokenAt("other", 0x500, now.Add(2*time.Second))

	t.Run("NoTokenNoDedupIsTheSameTask", func(t *testing.T) {
		task := hasynq.NewTask("t", []byte("p"), hasynq.MaxRetry(2))
		got, err := stamp(task, position.Token{}, false)
		require.NoError(t, err)
		require.Same(t, task, got)
	})
	t.Run("NewTaskGetsHeaderAndKeepsOptions", func(t *testing.T) {
		opts := []hasynq.Option{hasynq.Queue("critical"), hasynq.MaxRetry(2)}
		task := hasynq.NewTask("t", []byte("p"), opts...)
		got, err := stamp(task, t1, false)
		require.NoError(t, err)
		require.NotSame(t, task, got)
		require.Nil(t, task.Headers(), "the caller's task is not modified")
		require.Equal(t, header(t, t1), got.Headers()[position.HeaderName])
		require.Equal(t, "t", got.Type())
		require.Equal(t, []byte("p"), got.Payload())
		gotOpts, _ := taskOptions(got)
		require.Equal(t, opts, gotOpts)
		require.Equal(t, len(gotOpts), cap(gotOpts), "options are clipped so asynq's append copies them")
	})
	t.Run("MergesWithTheHeaderMaxPerDatabase", func(t *testing.T) {
		task := hasynq.NewTaskWithHeaders("t", nil, map[string]string{position.HeaderName: header(t, t2), "x": "y"})
		got, err := stamp(task, t1.Merge(other), false)
		require.NoError(t, err)
		dec, err := position.Decode(got.Headers()[position.HeaderName])
		require.NoError(t, err)
		e, _ := dec.Entry("main")
		require.Equal(t, position.LSN(0x2000), e.LSN, "a lower position never replaces a higher one")
		e, ok := dec.Entry("other")
		require.True(t, ok)
		require.Equal(t, position.LSN(0x500), e.LSN)
		require.Equal(t, now.UnixMilli(), dec.CapturedAt.UnixMilli(), "the oldest capture time is kept")
		require.Equal(t, "y", got.Headers()["x"])
		require.Equal(t, header(t, t2), task.Headers()[position.HeaderName], "the caller's headers are not modified")
	})
	t.Run("NothingNewIsTheSameTask", func(t *testing.T) {
		task := hasynq.NewTaskWithHeaders("t", nil, map[string]string{position.HeaderName: header(t, t1)})
		got, err := stamp(task, t2.With(position.Entry{Database: "main", Epoch: epoch, LSN: 0x10}, now.Add(time.Hour)), false)
		require.NoError(t, err)
		require.NotSame(t, task, got, "a higher position is stamped")
		got, err = stamp(task, tokenAt("main", 0x800, now.Add(time.Hour)), false)
		require.NoError(t, err)
		require.Same(t, task, got)
	})
	t.Run("MalformedHeaderIsKept", func(t *testing.T) {
		task := hasynq.NewTaskWithHeaders("t", nil, map[string]string{position.HeaderName: "garbage"})
		got, err := stamp(task, t1, false)
		require.NoError(t, err)
		require.Equal(t, "garbage", got.Headers()[position.HeaderName], "unknown stays unknown: the consumer reads the primary")
	})
	t.Run("DedupMarker", func(t *testing.T) {
		task := hasynq.NewTask("t", nil, hasynq.Unique(time.Minute))
		got, err := stamp(task, position.Token{}, true)
		require.NoError(t, err)
		require.Equal(t, "1", got.Headers()[HeaderDedup])
		require.NotContains(t, got.Headers(), position.HeaderName)
		again, err := stamp(got, position.Token{}, true)
		require.NoError(t, err)
		require.Same(t, got, again)
	})
	t.Run("TooManyDatabases", func(t *testing.T) {
		var tok position.Token
		for i := range position.MaxDatabases + 1 {
			tok = tok.Merge(tokenAt(fmt.Sprintf("db%d", i), 1, now))
		}
		_, err := stamp(hasynq.NewTask("t", nil), tok, false)
		require.ErrorIs(t, err, position.ErrTooLarge)
	})
}

func TestDedupOption(t *testing.T) {
	t.Parallel()
	require.False(t, dedupOption(nil))
	require.False(t, dedupOption([]hasynq.Option{hasynq.Queue("q"), hasynq.MaxRetry(1), nil}))
	require.True(t, dedupOption([]hasynq.Option{hasynq.Queue("q"), hasynq.Unique(time.Second)}))
	require.True(t, dedupOption([]hasynq.Option{hasynq.TaskID("id")}))
}

func TestNewTask(t *testing.T) {
	t.Parallel()
	tok := tokenAt("main", 0x1000, time.UnixMilli(1_700_000_000_000))
	plain := NewTask(context.Background(), "t", []byte("p"), hasynq.MaxRetry(1))
	require.Nil(t, plain.Headers())
	ctx := enqueue.WithToken(context.Background(), tok)
	task := NewTask(ctx, "t", []byte("p"), hasynq.MaxRetry(1), hasynq.TaskID("x"))
	require.Equal(t, header(t, tok), task.Headers()[position.HeaderName])
	require.Equal(t, "1", task.Headers()[HeaderDedup])
	opts, _ := taskOptions(task)
	require.Len(t, opts, 2)
}

func TestRetryDelay(t *testing.T) {
	t.Parallel()
	base := time.Unix(1_700_000_000, 0)
	for _, tc := range []struct {
		now  time.Time
		d    time.Duration
		want time.Duration
	}{
		{base, time.Second, time.Second},
		{base.Add(300 * time.Millisecond), time.Second, 1700 * time.Millisecond},
		{base.Add(999 * time.Millisecond), 1500 * time.Millisecond, 2001 * time.Millisecond},
		{base.Add(time.Nanosecond), 0, time.Second - time.Nanosecond},
		{base, -time.Second, 0},
	} {
		got := retryDelay(tc.d, tc.now)
		require.Equal(t, tc.want, got, "now=%v d=%v", tc.now.Sub(base), tc.d)
		// What asynq does with it: processAt = (now + got).Unix().
		due := time.Unix(tc.now.Add(got).Unix(), 0)
		require.False(t, due.Before(tc.now.Add(tc.d)), "due before the delay passed")
		require.Less(t, due.Sub(tc.now.Add(max(tc.d, 0))), time.Second)
	}
}

func TestServerConfigHooks(t *testing.T) {
	t.Parallel()
	deferred := &consume.DeferError{Delay: 1500 * time.Millisecond, Decision: consume.Decision{Outcome: consume.OutcomeDeferred}}
	capped := &consume.DeferError{Delay: 4 * time.Second, Decision: consume.Decision{Outcome: consume.OutcomeCapped}}
	real := errors.New("boom")

	t.Run("Defaults", func(t *testing.T) {
		cfg := ServerConfig(hasynq.Config{})
		require.Equal(t, DelayedTaskCheckInterval, cfg.DelayedTaskCheckInterval)
		require.False(t, cfg.IsFailure(deferred))
		require.False(t, cfg.IsFailure(fmt.Errorf("wrapped: %w", deferred)))
		require.True(t, cfg.IsFailure(capped))
		require.True(t, cfg.IsFailure(real))
		d := cfg.RetryDelayFunc(3, deferred, hasynq.NewTask("t", nil))
		require.GreaterOrEqual(t, d, 1500*time.Millisecond)
		require.LessOrEqual(t, d, 2500*time.Millisecond)
		d = cfg.RetryDelayFunc(3, capped, hasynq.NewTask("t", nil))
		require.GreaterOrEqual(t, d, 4*time.Second)
		require.LessOrEqual(t, d, 5*time.Second)
		d = cfg.RetryDelayFunc(3, real, hasynq.NewTask("t", nil))
		require.Positive(t, d, "asynq's default backoff")
	})
	t.Run("UserHooksForRealErrorsOnly", func(t *testing.T) {
		var delays, failures, handled int
		cfg := ServerConfig(hasynq.Config{
			DelayedTaskCheckInterval: 200 * time.Millisecond,
			RetryDelayFunc: func(n int, err error, task *hasynq.Task) time.Duration {
				delays++
				return time.Duration(n) * time.Hour
			},
			IsFailure: func(err error) bool { failures++; return !errors.Is(err, context.Canceled) },
			ErrorHandler: hasynq.ErrorHandlerFunc(func(context.Context, *hasynq.Task, error) {
				handled++
			}),
		})
		require.Equal(t, 200*time.Millisecond, cfg.DelayedTaskCheckInterval)
		require.False(t, cfg.IsFailure(deferred))
		require.True(t, cfg.IsFailure(capped))
		cfg.RetryDelayFunc(0, deferred, nil)
		cfg.ErrorHandler.HandleError(context.Background(), nil, deferred)
		require.Zero(t, delays+failures+handled, "deferrals never reach the user's hooks")

		require.Equal(t, 7*time.Hour, cfg.RetryDelayFunc(7, real, nil))
		require.True(t, cfg.IsFailure(real))
		require.False(t, cfg.IsFailure(context.Canceled))
		cfg.ErrorHandler.HandleError(context.Background(), nil, real)
		cfg.ErrorHandler.HandleError(context.Background(), nil, capped)
		require.Equal(t, 1, delays)
		require.Equal(t, 2, failures)
		require.Equal(t, 2, handled, "refusals by the cap are errors the user hears about")
	})
}

func TestAggregator(t *testing.T) {
	t.Parallel()
	now := time.UnixMilli(1_700_000_000_000)
	t1, t2 := tokenAt("main", 0x1000, now), tokenAt("main", 0x3000, now.Add(time.Second))
	ga := hasynq.GroupAggregatorFunc(func(group string, tasks []*hasynq.Task) *hasynq.Task {
		return hasynq.NewTask("batch:"+group, nil, hasynq.MaxRetry(4))
	})
	cfg := ServerConfig(hasynq.Config{GroupAggregator: ga})
	with := func(tok position.Token, extra ...string) *hasynq.Task {
		h := map[string]string{position.HeaderName: header(t, tok)}
		for i := 0; i+1 < len(extra); i += 2 {
			h[extra[i]] = extra[i+1]
		}
		return hasynq.NewTaskWithHeaders("item", nil, h)
	}

	out := cfg.GroupAggregator.Aggregate("g", []*hasynq.Task{with(t1), with(t2)})
	require.Equal(t, "batch:g", out.Type())
	require.Equal(t, header(t, t1.Merge(t2)), out.Headers()[position.HeaderName])
	require.NotContains(t, out.Headers(), HeaderDedup)
	opts, _ := taskOptions(out)
	require.Len(t, opts, 1, "the aggregate keeps its options")

	out = cfg.GroupAggregator.Aggregate("g", []*hasynq.Task{with(t1), hasynq.NewTask("item", nil), with(t2, HeaderDedup, "1")})
	require.NotContains(t, out.Headers(), position.HeaderName, "a member without a token sends the aggregate to the primary")
	require.Equal(t, "1", out.Headers()[HeaderDedup])

	own := hasynq.GroupAggregatorFunc(func(string, []*hasynq.Task) *hasynq.Task {
		return hasynq.NewTaskWithHeaders("batch", nil, map[string]string{position.HeaderName: header(t, t2)})
	})
	out = ServerConfig(hasynq.Config{GroupAggregator: own}).GroupAggregator.Aggregate("g", []*hasynq.Task{with(t1), hasynq.NewTask("item", nil)})
	require.NotContains(t, out.Headers(), position.HeaderName)
}

func TestMiddlewareConfigValidate(t *testing.T) {
	t.Parallel()
	require.NoError(t, MiddlewareConfig{}.Validate())
	require.NoError(t, MiddlewareConfig{Policies: map[string]consume.Policy{"a:": consume.Always}}.Validate())
	require.Error(t, MiddlewareConfig{DefaultPolicy: 9}.Validate())
	require.Error(t, MiddlewareConfig{Policies: map[string]consume.Policy{"a": 9}}.Validate())
	require.Error(t, MiddlewareConfig{Policies: map[string]consume.Policy{" ": consume.Sticky}}.Validate())
	require.Panics(t, func() { Middleware(nil, MiddlewareConfig{}) })
}

func TestPolicyMatching(t *testing.T) {
	t.Parallel()
	p := newPolicies(map[string]consume.Policy{
		"email:":        consume.Delayed,
		"email:urgent":  consume.Sticky,
		"email:urgent:": consume.Always,
		"report":        consume.Always,
	}, consume.PolicyDefault)
	for typ, want := range map[string]consume.Policy{
		"email:welcome":     consume.Delayed,
		"email:urgent":      consume.Sticky,
		"email:urgent:page": consume.Always,
		"email:urgently":    consume.Sticky,
		"report":            consume.Always,
		"reports:daily":     consume.Always,
		"other":             consume.PolicyDefault,
	} {
		require.Equal(t, want, p.lookup(typ), typ)
	}
}
