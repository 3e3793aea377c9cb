package consume

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/testkit/spantest"
)

// tracedRouter is unitRouter with spans recorded in memory.
func tracedRouter(t *testing.T, s func(*Config)) (*Router, *tracetest.InMemoryExporter, trace.Tracer) {
	t.Helper()
	exp, tp := spantest.New(t)
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/9000"))), func(c *Config) {
		c.TracerProvider = tp
		c.Now = func() time.Time { return t0 }
		if s != nil {
			s(c)
		}
	})
	return r, exp, tp.Tracer("test")
}

// TestRouteSpan: Route makes one caughtup.route span, a child of the
// caller's span, with the decision as attributes; the handler's context
// keeps the caller's span, not the ended route span.
func TestRouteSpan(t *testing.T) {
	t.Parallel()
	r, exp, tracer := tracedRouter(t, nil)
	parent, ps := tracer.Start(context.Background(), "job")
	hctx, d, err := r.Route(parent, Job{Token: tok(time.Second, ent("main", 1, "0/100")), Policy: Sticky, Source: "asynq email:send"})
	require.NoError(t, err)
	require.Equal(t, OutcomeReplica, d.Outcome)
	require.Equal(t, ps.SpanContext(), trace.SpanContextFromContext(hctx), "the handler's spans are the caller's children")
	ps.End()

	routes := spantest.Named(exp, SpanRoute)
	require.Len(t, routes, 1)
	s := routes[0]
	require.Equal(t, ps.SpanContext().SpanID(), s.Parent.SpanID())
	require.Equal(t, ps.SpanContext().TraceID(), s.SpanContext.TraceID())
	a := spantest.Attrs(s)
	require.Equal(t, "sticky", a["caughtup.policy"].AsString())
	require.Equal(t, "run", a["caughtup.action"].AsString())
	require.Equal(t, "replica", a["caughtup.outcome"].AsString())
	require.Equal(t, "none", a["caughtup.reason"].AsString())
	require.Equal(t, "main", a["caughtup.database"].AsString())
	require.Equal(t, "r1", a["caughtup.replica"].AsString())
	require.False(t, a["caughtup.fallback"].AsBool())
	require.InDelta(t, 1.0, a["caughtup.token.age"].AsFloat64(), 1e-9)
	require.Equal(t, "asynq email:send", a["caughtup.source"].AsString())
	require.Equal(t, codes.Unset, s.Status.Code)
	require.Empty(t, spantest.Named(exp, SpanWait), "no wait")
}

// TestRouteSpanUnknownState: what the unknown state paths decided is on
// the span: no token and a malformed token read the primary, a token no
// replica serves is deferred, and a deferral is not an error.
func TestRouteSpanUnknownState(t *testing.T) {
	t.Parallel()
	r, exp, tracer := tracedRouter(t, func(c *Config) { c.WaitBudget = -1 })
	ctx, job := tracer.Start(context.Background(), "job")
	defer job.End()

	_, _, err := r.Route(ctx, Job{Policy: Delayed})
	require.NoError(t, err)
	_, _, err = r.Route(ctx, Job{TokenErr: errors.New("bad base64"), Policy: Delayed, Source: "kafka orders"})
	require.NoError(t, err)
	_, d, err := r.Route(ctx, Job{Token: tok(time.Second, ent("main", 1, "0/8000000")), Policy: Delayed})
	var de *DeferError
	require.ErrorAs(t, err, &de)
	require.Equal(t, ActionDefer, d.Action)

	routes := spantest.Named(exp, SpanRoute)
	require.Len(t, routes, 3)
	noTok, bad, behind := spantest.Attrs(routes[0]), spantest.Attrs(routes[1]), spantest.Attrs(routes[2])
	require.Equal(t, "primary_no_token", noTok["caughtup.outcome"].AsString())
	require.Equal(t, "no_token", noTok["caughtup.reason"].AsString())
	require.Equal(t, "malformed_token", bad["caughtup.reason"].AsString())
	require.Equal(t, "kafka orders", bad["caughtup.source"].AsString())
	require.Equal(t, "defer", behind["caughtup.action"].AsString())
	require.Equal(t, "replica_behind", behind["caughtup.reason"].AsString())
	require.InDelta(t, d.Delay.Seconds(), behind["caughtup.defer.delay"].AsFloat64(), 1e-9)
	for _, s := range routes {
		require.Equal(t, codes.Unset, s.Status.Code, "a decision is not a failure")
	}
}

// TestWaitSpan: a job that waits inside Route gets a caughtup.wait child
// of its route span; a wait its context abandons marks both as errors.
func TestWaitSpan(t *testing.T) {
	t.Parallel()
	r, exp, tracer := tracedRouter(t, func(c *Config) { c.WaitBudget = 30 * time.Millisecond })
	parent, job := tracer.Start(context.Background(), "job")
	defer job.End()
	_, d, err := r.Route(parent, Job{Token: tok(time.Second, ent("main", 1, "0/8000000")), Policy: Delayed})
	require.Error(t, err)
	require.Equal(t, ActionDefer, d.Action, "the budget ran out")
	waits, routes := spantest.Named(exp, SpanWait), spantest.Named(exp, SpanRoute)
	require.Len(t, waits, 1)
	require.Len(t, routes, 1)
	require.Equal(t, routes[0].SpanContext.SpanID(), waits[0].Parent.SpanID())
	require.Equal(t, "replica", spantest.Attrs(waits[0])["caughtup.wait.for"].AsString())
	require.Equal(t, "defer", spantest.Attrs(waits[0])["caughtup.action"].AsString())

	exp.Reset()
	// Cancelled before the wait can end by its budget, however slow the
	// machine: the wait is abandoned.
	ctx, cancel := context.WithCancel(parent)
	cancel()
	_, _, err = r.Route(ctx, Job{Token: tok(time.Second, ent("main", 1, "0/8000000")), Policy: Delayed})
	require.ErrorIs(t, err, context.Canceled)
	waits, routes = spantest.Named(exp, SpanWait), spantest.Named(exp, SpanRoute)
	require.Len(t, waits, 1)
	require.Len(t, routes, 1)
	require.Equal(t, codes.Error, waits[0].Status.Code)
	require.Equal(t, codes.Error, routes[0].Status.Code)
}

// TestHoldSpan: a held job's wait for the fallback cap is a caughtup.wait
// span too.
func TestHoldSpan(t *testing.T) {
	t.Parallel()
	r, exp, tracer := tracedRouter(t, func(c *Config) {
		c.PrimaryRate, c.PrimaryBurst = rate.Every(50*time.Millisecond), 1
		c.WaitBudget = -1
	})
	ctx, job := tracer.Start(context.Background(), "job")
	defer job.End()
	behind := tok(time.Second, ent("main", 1, "0/8000000"))
	_, _, err := r.Route(ctx, Job{Token: behind, Policy: Sticky}) // the burst
	require.NoError(t, err)
	_, d, err := r.Route(ctx, Job{Token: behind, Policy: Sticky, NoDefer: true, Hold: true})
	require.NoError(t, err)
	require.True(t, d.Held)
	waits := spantest.Named(exp, SpanWait)
	require.Len(t, waits, 1)
	require.Equal(t, "replica_or_fallback_cap", spantest.Attrs(waits[0])["caughtup.wait.for"].AsString())
	routes := spantest.Named(exp, SpanRoute)
	require.True(t, spantest.Attrs(routes[1])["caughtup.held"].AsBool())
	require.True(t, spantest.Attrs(routes[1])["caughtup.fallback"].AsBool())
}

// TestNoSpanOutsideTrace: a job whose context has no span gets none, not
// a one-span trace of its own: caughtup's spans join traces, they never
// start one; neither does its wait.
func TestNoSpanOutsideTrace(t *testing.T) {
	t.Parallel()
	r, exp, _ := tracedRouter(t, func(c *Config) { c.WaitBudget = 20 * time.Millisecond })
	_, d, err := r.Route(context.Background(), Job{Token: tok(time.Second, ent("main", 1, "0/100")), Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomeReplica, d.Outcome)
	_, d, err = r.Route(context.Background(), Job{Token: tok(time.Second, ent("main", 1, "0/8000000")), Policy: Delayed})
	require.Error(t, err)
	require.Equal(t, ActionDefer, d.Action, "it waited, then was deferred")
	require.Empty(t, exp.GetSpans())
}

// TestTraceAttributesSeveralDatabases: a job of two databases names both,
// and the replica each read, in slices.
func TestTraceAttributesSeveralDatabases(t *testing.T) {
	t.Parallel()
	d := Decision{Databases: []DatabaseDecision{{Database: "a", Replica: "r1"}, {Database: "b"}}}
	m := map[string]attribute.Value{}
	for _, kv := range TraceAttributes(&d) {
		m[string(kv.Key)] = kv.Value
	}
	require.Equal(t, []string{"a", "b"}, m["caughtup.databases"].AsStringSlice())
	require.Equal(t, []string{"r1", ""}, m["caughtup.replicas"].AsStringSlice())
	_, single := m["caughtup.database"]
	require.False(t, single)
}

// TestTallyRouteSpan: a Tally that routed jobs in a context without a span
// (which it remembers) still gives a job in a traced context its route
// span, and a job in a context that only wraps the untraced one none;
// jobs each in a context of their own of a type that cannot be compared
// are routed too.
func TestTallyRouteSpan(t *testing.T) {
	t.Parallel()
	r, exp, tracer := tracedRouter(t, nil)
	tally := r.NewTally()
	job := Job{Token: tok(time.Second, ent("main", 1, "0/100")), Policy: Sticky}
	plain := context.Background()
	for range 3 {
		_, _, err := tally.Route(plain, job)
		require.NoError(t, err)
	}
	require.Empty(t, spantest.Named(exp, SpanRoute), "no trace, no span")
	traced, ps := tracer.Start(plain, "job")
	_, _, err := tally.Route(traced, job)
	require.NoError(t, err)
	ps.End()
	require.Len(t, spantest.Named(exp, SpanRoute), 1, "a traced job after untraced ones gets its span")
	type key struct{}
	_, _, err = tally.Route(context.WithValue(plain, key{}, 1), job)
	require.NoError(t, err)
	_, _, err = tally.Route(uncomparable{plain, []int{1}}, job)
	require.NoError(t, err)
	_, _, err = tally.Route(uncomparable{traced, []int{2}}, job)
	require.NoError(t, err)
	require.Len(t, spantest.Named(exp, SpanRoute), 2, "only traced jobs get spans")
	_, _, err = tally.Route(plain, job)
	require.NoError(t, err)
	require.Len(t, spantest.Named(exp, SpanRoute), 2)
}

// uncomparable is a context whose type == panics on.
type uncomparable struct {
	context.Context
	_ []int
}
