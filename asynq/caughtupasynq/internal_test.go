package caughtupasynq

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/metrictest"
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

func testMetrics(t *testing.T) (*metrics, *sdkmetric.ManualReader) {
	t.Helper()
	r := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m, err := newMetrics(mp)
	require.NoError(t, err)
	return m, r
}

func counter(t *testing.T, r *sdkmetric.ManualReader, name string) int64 {
	t.Helper()
	return metrictest.Sum(t, r, name)
}

func TestNewTask(t *testing.T) {
	t.Parallel()
	tok := tokenAt("main", 0x1000, time.UnixMilli(1_700_000_000_000))
	opts := []asynq.Option{asynq.MaxRetry(1), asynq.TaskID("x")}

	plain := NewTask(context.Background(), "t", []byte("p"), asynq.MaxRetry(1))
	require.Nil(t, plain.Headers(), "nothing to carry: no headers, as asynq.NewTask")
	got, ok := optionsOf(plain)
	require.True(t, ok, "the options are recorded")
	require.Equal(t, []asynq.Option{asynq.MaxRetry(1)}, got)

	ctx := enqueue.WithToken(context.Background(), tok)
	task := NewTask(ctx, "t", []byte("p"), opts...)
	require.Equal(t, map[string]string{position.HeaderName: header(t, tok), HeaderDedup: "1"}, task.Headers(),
		"stamped when built, for plain asynq clients; no HeaderDeadline, since the enqueue's options are not known yet")
	got, ok = optionsOf(task)
	require.True(t, ok)
	require.Equal(t, opts, got)
	require.Equal(t, len(got), cap(got), "clipped, so that asynq's append copies")

	mine := map[string]string{"trace": "abc", position.HeaderName: "garbage"}
	task = NewTaskWithHeaders(ctx, "t", nil, mine)
	require.Equal(t, map[string]string{"trace": "abc", position.HeaderName: "garbage"}, task.Headers(), "a malformed header stays malformed")
	task.Headers()["x"] = "y"
	require.NotContains(t, mine, "x", "the caller's map is copied")

	_, ok = optionsOf(asynq.NewTask("t", nil))
	require.False(t, ok, "asynq.NewTask's options cannot be known")
}

func TestStamp(t *testing.T) {
	t.Parallel()
	now := time.UnixMilli(1_700_000_000_000)
	t1 := tokenAt("main", 0x1000, now)
	t2 := tokenAt("main", 0x2000, now.Add(time.Second))
	other := tokenAt("other", 0x500, now.Add(2*time.Second))
	bg := context.Background()

	t.Run("NothingToAddIsTheSameTask", func(t *testing.T) {
		for _, task := range []*asynq.Task{
			NewTask(bg, "t", []byte("p"), asynq.MaxRetry(2)),
			asynq.NewTask("t", []byte("p"), asynq.MaxRetry(2)),
			asynq.NewTask("t", nil, asynq.Unique(time.Hour)), // no token: the marker is optional
		} {
			got, err := stamp(task, position.Token{}, nil, true)
			require.NoError(t, err)
			require.Same(t, task, got)
		}
	})
	t.Run("KnownTaskGetsHeadersAndKeepsOptions", func(t *testing.T) {
		deadline := time.Unix(1_800_000_000, 0)
		opts := []asynq.Option{asynq.Queue("critical"), asynq.MaxRetry(2), asynq.Deadline(deadline)}
		task := NewTask(bg, "t", []byte("p"), opts...)
		got, err := stamp(task, t1, []asynq.Option{asynq.Unique(time.Minute)}, true)
		require.NoError(t, err)
		require.NotSame(t, task, got)
		require.Nil(t, task.Headers(), "the caller's task is not modified")
		require.Equal(t, map[string]string{
			position.HeaderName: header(t, t1),
			HeaderDedup:         "1",
			HeaderDeadline:      "1800000000",
		}, got.Headers())
		require.Equal(t, "t", got.Type())
		require.Equal(t, []byte("p"), got.Payload())
		gotOpts, ok := optionsOf(got)
		require.True(t, ok, "the stamped copy is known too, so that a Client behind a Client stamps it")
		require.Equal(t, opts, gotOpts)
	})
	t.Run("TheTokenNewTaskStampedIsNotMergedAgain", func(t *testing.T) {
		task := NewTask(enqueue.WithToken(bg, t1), "t", nil)
		b, ok := builtOf(task)
		require.True(t, ok)
		require.True(t, sameToken(t1, b.stamped), "NewTask records the token it merged")
		got, err := stamp(task, t1, nil, true)
		require.NoError(t, err)
		require.Equal(t, header(t, t1), got.Headers()[position.HeaderName])
		require.Equal(t, "0", got.Headers()[HeaderDedup])

		// Another token (a later write, or the same LSN captured earlier)
		// is merged: the header is never left behind the context's token.
		for _, later := range []position.Token{t2, other, tokenAt("main", 0x1000, now.Add(-time.Second))} {
			got, err = stamp(task, later, nil, true)
			require.NoError(t, err)
			require.Equal(t, header(t, t1.Merge(later)), got.Headers()[position.HeaderName])
		}
		// A header the caller gave that NewTask did not change records no
		// token: Client merges as for any known task.
		task = NewTaskWithHeaders(enqueue.WithToken(bg, t1), "t", nil, map[string]string{position.HeaderName: header(t, t1)})
		b, _ = builtOf(task)
		require.True(t, b.stamped.IsZero())
		got, err = stamp(task, t2, nil, true)
		require.NoError(t, err)
		require.Equal(t, header(t, t1.Merge(t2)), got.Headers()[position.HeaderName])
	})
	t.Run("DeadlineAtEnqueueWins", func(t *testing.T) {
		task := NewTask(bg, "t", nil, asynq.Deadline(time.Unix(100, 0)), asynq.Timeout(time.Minute))
		got, err := stamp(task, t1, []asynq.Option{asynq.Deadline(time.Unix(200, 500))}, true)
		require.NoError(t, err)
		require.Equal(t, "200", got.Headers()[HeaderDeadline])
		got, err = stamp(NewTask(bg, "t", nil, asynq.Timeout(time.Minute)), t1, nil, true)
		require.NoError(t, err)
		require.Equal(t, "0", got.Headers()[HeaderDeadline], "a Timeout is no deadline")
	})
	t.Run("MergesWithTheHeaderMaxPerDatabase", func(t *testing.T) {
		task := NewTaskWithHeaders(bg, "t", nil, map[string]string{position.HeaderName: header(t, t2), "x": "y"})
		got, err := stamp(task, t1.Merge(other), nil, true)
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
	t.Run("StampedTwiceIsTheSameTask", func(t *testing.T) {
		got, err := stamp(NewTask(bg, "t", nil), t1, nil, true)
		require.NoError(t, err)
		again, err := stamp(got, tokenAt("main", 0x800, now.Add(time.Hour)), nil, true)
		require.NoError(t, err)
		require.Same(t, got, again, "nothing new")
	})
	t.Run("MalformedHeaderIsKept", func(t *testing.T) {
		task := asynq.NewTaskWithHeaders("t", nil, map[string]string{position.HeaderName: "garbage"})
		got, err := stamp(task, t1, nil, true)
		require.NoError(t, err)
		require.Same(t, task, got, "unknown stays unknown: the consumer reads the primary, and nothing changes")
	})
	t.Run("ForeignTaskNeedingATokenIsRefused", func(t *testing.T) {
		for _, task := range []*asynq.Task{
			asynq.NewTask("t", nil, asynq.MaxRetry(3)),
			asynq.NewTaskWithHeaders("t", nil, map[string]string{"x": "y"}),
			asynq.NewTaskWithHeaders("t", nil, map[string]string{position.HeaderName: header(t, t1)}),
		} {
			_, err := stamp(task, t2, nil, true)
			require.ErrorIs(t, err, ErrForeignTask)
			require.ErrorContains(t, err, "caughtupasynq.NewTask")
		}
		_, err := stamp(asynq.NewTaskWithHeaders("t", nil, map[string]string{position.HeaderName: header(t, t1)}), position.Token{},
			[]asynq.Option{asynq.Unique(time.Minute)}, true)
		require.ErrorIs(t, err, ErrForeignTask, "a token without the dedup marker would miss the duplicates' writes")
		task := asynq.NewTaskWithHeaders("t", nil, map[string]string{position.HeaderName: header(t, t2)})
		got, err := stamp(task, tokenAt("main", 0x1000, now.Add(time.Hour)), nil, true)
		require.NoError(t, err)
		require.Same(t, task, got, "a header that already covers the token (higher position, older capture) needs nothing")
	})
	t.Run("TooManyDatabases", func(t *testing.T) {
		var tok position.Token
		for i := range position.MaxDatabases + 1 {
			tok = tok.Merge(tokenAt(fmt.Sprintf("db%d", i), 1, now))
		}
		_, err := stamp(NewTask(bg, "t", nil), tok, nil, true)
		require.ErrorIs(t, err, position.ErrTooLarge)
		task := NewTask(enqueue.WithToken(bg, tok), "t", nil)
		require.Empty(t, task.Headers()[position.HeaderName], "NewTask leaves a token it cannot carry out")
	})
}

func TestDedupOption(t *testing.T) {
	t.Parallel()
	require.False(t, dedupOption(nil))
	require.False(t, dedupOption([]asynq.Option{asynq.Queue("q"), asynq.MaxRetry(1), nil}))
	require.True(t, dedupOption([]asynq.Option{asynq.Queue("q"), asynq.Unique(time.Second)}))
	require.True(t, dedupOption([]asynq.Option{asynq.TaskID("id")}))
}

func TestDeadlineHeader(t *testing.T) {
	t.Parallel()
	require.Equal(t, "0", deadlineValue(nil))
	require.Equal(t, "0", deadlineValue([]asynq.Option{asynq.Timeout(time.Second), nil}))
	require.Equal(t, "0", deadlineValue([]asynq.Option{asynq.Deadline(time.Time{})}), "asynq ignores a zero Deadline")
	require.Equal(t, "42", deadlineValue([]asynq.Option{asynq.Deadline(time.Unix(42, 999))}))
	require.Equal(t, "7", deadlineValue([]asynq.Option{asynq.Deadline(time.Unix(42, 0))}, []asynq.Option{asynq.Deadline(time.Unix(7, 0))}))
	for v, want := range map[string]struct {
		has, ok bool
	}{"0": {false, true}, "1800000000": {true, true}, "": {false, false}, "-5": {false, false}, "soon": {false, false}} {
		dl, has, ok := parseDeadline(v)
		require.Equal(t, want.has, has, v)
		require.Equal(t, want.ok, ok, v)
		if has {
			require.Equal(t, v, strconv.FormatInt(dl.Unix(), 10))
		}
	}
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
	capped := &consume.DeferError{Delay: 4 * time.Second, Decision: consume.Decision{Action: consume.ActionRefuse, Outcome: consume.OutcomeCapped}}
	real := errors.New("boom")

	t.Run("Defaults", func(t *testing.T) {
		cfg := ServerConfig(asynq.Config{})
		require.Equal(t, DelayedTaskCheckInterval, cfg.DelayedTaskCheckInterval)
		require.Equal(t, TaskCheckInterval, cfg.TaskCheckInterval)
		require.False(t, cfg.IsFailure(deferred))
		require.False(t, cfg.IsFailure(fmt.Errorf("wrapped: %w", deferred)))
		require.True(t, cfg.IsFailure(capped))
		require.True(t, cfg.IsFailure(real))
		d := cfg.RetryDelayFunc(3, deferred, asynq.NewTask("t", nil))
		require.GreaterOrEqual(t, d, 1500*time.Millisecond)
		require.LessOrEqual(t, d, 2500*time.Millisecond)
		d = cfg.RetryDelayFunc(3, capped, asynq.NewTask("t", nil))
		require.GreaterOrEqual(t, d, 4*time.Second)
		require.LessOrEqual(t, d, 5*time.Second)
		d = cfg.RetryDelayFunc(3, real, asynq.NewTask("t", nil))
		require.Positive(t, d, "asynq's default backoff")
	})
	t.Run("UserHooksForRealErrorsOnly", func(t *testing.T) {
		var delays, failures, handled int
		cfg := ServerConfig(asynq.Config{
			DelayedTaskCheckInterval: 200 * time.Millisecond,
			TaskCheckInterval:        time.Second,
			RetryDelayFunc: func(n int, err error, task *asynq.Task) time.Duration {
				delays++
				return time.Duration(n) * time.Hour
			},
			IsFailure: func(err error) bool { failures++; return !errors.Is(err, context.Canceled) },
			ErrorHandler: asynq.ErrorHandlerFunc(func(context.Context, *asynq.Task, error) {
				handled++
			}),
		})
		require.Equal(t, 200*time.Millisecond, cfg.DelayedTaskCheckInterval)
		require.Equal(t, time.Second, cfg.TaskCheckInterval, "the user's interval is kept")
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
	t.Run("MarkTheDeferralsTheySee", func(t *testing.T) {
		cfg := ServerConfig(asynq.Config{})
		d := &deferral{DeferError: deferred}
		var de *consume.DeferError
		require.ErrorAs(t, d, &de, "a deferral is the router's DeferError")
		require.ErrorIs(t, d, consume.ErrDeferred)
		require.False(t, cfg.IsFailure(d))
		require.Equal(t, seenIsFailure, d.seen.Load())
		cfg.RetryDelayFunc(0, fmt.Errorf("wrapped: %w", d), nil)
		require.Equal(t, seenIsFailure|seenRetryDelay, d.seen.Load())
	})
}

func TestAggregator(t *testing.T) {
	t.Parallel()
	now := time.UnixMilli(1_700_000_000_000)
	t1, t2 := tokenAt("main", 0x1000, now), tokenAt("main", 0x3000, now.Add(time.Second))
	bg := context.Background()
	with := func(tok position.Token, extra ...string) *asynq.Task {
		h := map[string]string{position.HeaderName: header(t, tok)}
		for i := 0; i+1 < len(extra); i += 2 {
			h[extra[i]] = extra[i+1]
		}
		// What asynq's aggregator hands over.
		return asynq.NewTaskWithHeaders("item", nil, h)
	}
	aggregate := func(build func(group string, tasks []*asynq.Task) *asynq.Task, tasks ...*asynq.Task) (*asynq.Task, int64, string) {
		met, r := testMetrics(t)
		var logs bytes.Buffer
		cfg := serverConfig(asynq.Config{GroupAggregator: asynq.GroupAggregatorFunc(build)}, met, slog.New(slog.NewTextHandler(&logs, nil)))
		out := cfg.GroupAggregator.Aggregate("g", tasks)
		return out, counter(t, r, "caughtup.asynq.aggregates.unstamped"), logs.String()
	}

	t.Run("KnownOptionsAreRebuilt", func(t *testing.T) {
		out, unstamped, _ := aggregate(func(group string, _ []*asynq.Task) *asynq.Task {
			return NewTask(bg, "batch:"+group, nil, asynq.MaxRetry(4), asynq.Deadline(time.Unix(1_800_000_000, 0)))
		}, with(t1, HeaderDedup, "0"), with(t2, HeaderDedup, "0"))
		require.Equal(t, "batch:g", out.Type())
		require.Equal(t, map[string]string{position.HeaderName: header(t, t1.Merge(t2)), HeaderDeadline: "1800000000", HeaderDedup: "0"}, out.Headers(),
			"members Client enqueued without deduplication, and known options: no primary round trip")
		require.Zero(t, unstamped) // TestGroupAggregatorCarriesGroupToken checks the options in Redis
	})
	t.Run("AMemberOfUnknownOptionsMayBeDeduplicated", func(t *testing.T) {
		out, _, _ := aggregate(func(group string, _ []*asynq.Task) *asynq.Task {
			return NewTask(bg, "batch:"+group, nil)
		}, with(t1, HeaderDedup, "0"), with(t2)) // t2 went through a plain asynq.Client
		require.Equal(t, "1", out.Headers()[HeaderDedup])
	})
	t.Run("AHeadersMapIsStampedInPlace", func(t *testing.T) {
		var built *asynq.Task
		out, unstamped, _ := aggregate(func(string, []*asynq.Task) *asynq.Task {
			built = asynq.NewTaskWithHeaders("batch", nil, map[string]string{"trace": "abc", HeaderDeadline: "5"}, asynq.MaxRetry(4))
			return built
		}, with(t1), with(t2, HeaderDedup, "1"))
		require.Same(t, built, out, "the same task, so asynq enqueues it with its own options")
		require.Equal(t, map[string]string{"trace": "abc", position.HeaderName: header(t, t1.Merge(t2)), HeaderDedup: "1"}, out.Headers(),
			"no HeaderDeadline: its options are unknown")
		require.Zero(t, unstamped)
	})
	t.Run("AMemberWithoutATokenSendsTheAggregateToThePrimary", func(t *testing.T) {
		out, unstamped, _ := aggregate(func(string, []*asynq.Task) *asynq.Task {
			return asynq.NewTaskWithHeaders("batch", nil, map[string]string{position.HeaderName: header(t, t2)})
		}, with(t1), asynq.NewTaskWithHeaders("item", nil, nil))
		require.NotContains(t, out.Headers(), position.HeaderName, "even a token the aggregator wrote goes")
		require.Zero(t, unstamped)
		out, unstamped, logs := aggregate(func(string, []*asynq.Task) *asynq.Task { return asynq.NewTask("batch", nil) },
			with(t1), asynq.NewTaskWithHeaders("item", nil, nil))
		require.Nil(t, out.Headers())
		require.Zero(t, unstamped, "nothing to carry: not an error")
		require.Empty(t, logs)
	})
	t.Run("AMalformedMemberStaysMalformed", func(t *testing.T) {
		out, _, _ := aggregate(func(string, []*asynq.Task) *asynq.Task { return NewTask(bg, "batch", nil) },
			with(t1), asynq.NewTaskWithHeaders("item", nil, map[string]string{position.HeaderName: "garbage"}))
		require.Equal(t, "garbage", out.Headers()[position.HeaderName], "the consumer reads the primary and counts a malformed token")
		out, _, _ = aggregate(func(string, []*asynq.Task) *asynq.Task {
			return asynq.NewTaskWithHeaders("batch", nil, map[string]string{position.HeaderName: "mine-garbage"})
		}, with(t1), with(t2))
		require.Equal(t, "mine-garbage", out.Headers()[position.HeaderName], "the aggregator's own unreadable header stays")
	})
	t.Run("ForeignAggregateIsLeftUnstampedLoudly", func(t *testing.T) {
		out, unstamped, logs := aggregate(func(string, []*asynq.Task) *asynq.Task {
			return asynq.NewTask("batch", nil, asynq.MaxRetry(4))
		}, with(t1), with(t2))
		require.Nil(t, out.Headers(), "left as it is: its options are unknown and it has no map")
		require.Equal(t, int64(1), unstamped)
		require.Contains(t, logs, "level=ERROR")
		require.Contains(t, logs, "caughtupasynq.NewTask")
	})
	t.Run("NilAggregate", func(t *testing.T) {
		out, _, _ := aggregate(func(string, []*asynq.Task) *asynq.Task { return nil }, with(t1))
		require.Nil(t, out)
	})
}

func TestMiddlewareConfigValidate(t *testing.T) {
	t.Parallel()
	require.NoError(t, MiddlewareConfig{WakeCapacity: -1}.Validate())
	require.NoError(t, MiddlewareConfig{Redis: asynq.RedisClientOpt{Addr: "127.0.0.1:1"}, Policies: map[string]consume.Policy{"a:": consume.Always}}.Validate())
	require.ErrorIs(t, MiddlewareConfig{}.Validate(), ErrInvalidConfig, "no way to wake deferred tasks")
	for _, bad := range []MiddlewareConfig{
		{DefaultPolicy: 9},
		{Policies: map[string]consume.Policy{"a": 9}},
		{Policies: map[string]consume.Policy{" ": consume.Sticky}},
	} {
		require.ErrorIs(t, bad.Validate(), ErrInvalidConfig)
	}
	require.Panics(t, func() { Middleware(nil, MiddlewareConfig{}) })
	_, err := NewServer(asynq.RedisClientOpt{Addr: "127.0.0.1:1"}, asynq.Config{}, nil, MiddlewareConfig{})
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = NewServer(nil, asynq.Config{}, nil, MiddlewareConfig{})
	require.ErrorIs(t, err, ErrInvalidConfig)
	d := MiddlewareConfig{}.WithDefaults()
	require.NotNil(t, d.Logger)
	require.NotNil(t, d.MeterProvider)
	mp := noop.NewMeterProvider()
	require.Equal(t, mp, MiddlewareConfig{MeterProvider: mp}.WithDefaults().MeterProvider)
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

func TestEnumNames(t *testing.T) {
	t.Parallel()
	for o := range override(numOverrides) {
		require.NotContains(t, o.String(), "override(", "override %d has no name", o)
	}
	require.Equal(t, "override(200)", override(200).String())
	require.Equal(t, "IsFailure", hookIsFailure.String())
	require.Equal(t, "RetryDelayFunc", hookRetryDelayFunc.String())
	require.Equal(t, "deadline", overrideDeadline.String())
}
