package caughtupasynq_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/testkit/spantest"
)

// TestTraceDeferAndWake follows one task's trace: the request that wrote
// the row and enqueued the task, the worker's first route (a wait, then a
// deferral) and caughtup.defer span, the wake that moved it once replay
// resumed, linked to the deferral, and the second route, on a replica,
// whose handler's context continues the request's trace through the W3C
// trace context in the task's headers.
func TestTraceDeferAndWake(t *testing.T) {
	exp, tp := spantest.New(t)
	prop := propagation.TraceContext{}
	// NewTask writes the trace context through the global propagators,
	// as otel contrib's producers do.
	before := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(prop)
	t.Cleanup(func() { otel.SetTextMapPropagator(before) })

	e := setup(t, slowDeferrals, func(c *consume.Config) { c.TracerProvider = tp })
	h, runs := starts()
	handlerSpans := make(chan trace.SpanContext, 4)
	traced := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		handlerSpans <- trace.SpanContextFromContext(ctx)
		return h.ProcessTask(ctx, task)
	})
	e.server(t, asynq.Config{}, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Delayed, TracerProvider: tp, Propagators: prop}, traced)
	resume := e.pauseAll(t)

	reqCtx, req := tp.Tracer("test").Start(ctxT(t), "POST /signup")
	ctx := e.write(t, reqCtx, 1)
	task := caughtupasynq.NewTask(ctx, "wake", []byte(strconv.Itoa(1)), asynq.MaxRetry(3), asynq.Queue(e.queue))
	require.NotEmpty(t, task.Headers()["traceparent"], "NewTask carries the trace context")
	info, err := e.client.EnqueueContext(ctx, task)
	require.NoError(t, err)
	req.End()
	waitFor(t, time.Minute, func() bool { return len(spantest.Named(exp, consume.SpanDefer)) == 1 }, "no caughtup.defer span")

	resume()
	s := nextStart(t, runs, 30*time.Second, "after the resume")
	require.Equal(t, info.ID, s.id)
	require.NotEmpty(t, replicaOf(s.dec))
	require.Equal(t, req.SpanContext().TraceID(), (<-handlerSpans).TraceID(), "the handler continues the request's trace")
	waitFor(t, 30*time.Second, func() bool { return len(spantest.Named(exp, consume.SpanWake)) > 0 }, "no caughtup.wake span")

	reqTrace := req.SpanContext().TraceID()
	routes := spantest.Named(exp, consume.SpanRoute)
	require.GreaterOrEqual(t, len(routes), 2, "a route per attempt")
	first, last := spantest.Attrs(routes[0]), spantest.Attrs(routes[len(routes)-1])
	require.Equal(t, "defer", first["caughtup.action"].AsString())
	require.Equal(t, "run", last["caughtup.action"].AsString())
	require.Equal(t, "replica", last["caughtup.outcome"].AsString())
	for _, r := range routes {
		require.Equal(t, reqTrace, r.SpanContext.TraceID(), "every route of the task is in the request's trace")
		require.Equal(t, req.SpanContext().SpanID(), r.Parent.SpanID(), "parented by the enqueuing span (no consumer span of the application's)")
	}
	require.NotEmpty(t, spantest.Named(exp, consume.SpanWait), "the first attempt waited out the budget")

	defers := spantest.Named(exp, consume.SpanDefer)
	require.Len(t, defers, 1)
	d := spantest.Attrs(defers[0])
	require.Equal(t, reqTrace, defers[0].SpanContext.TraceID())
	require.Equal(t, trace.SpanKindConsumer, defers[0].SpanKind)
	require.Equal(t, "asynq", d["messaging.system"].AsString())
	require.Equal(t, "wake", d["caughtup.asynq.task_type"].AsString())
	require.Equal(t, e.queue, d["messaging.destination.name"].AsString())
	require.Equal(t, info.ID, d["messaging.message.id"].AsString())
	require.Equal(t, "replica_behind", d["caughtup.reason"].AsString())
	require.Positive(t, d["caughtup.defer.delay"].AsFloat64())

	wakes := spantest.Named(exp, consume.SpanWake)
	var linked bool
	for _, w := range wakes {
		a := spantest.Attrs(w)
		require.Equal(t, e.queue, a["messaging.destination.name"].AsString())
		for _, l := range w.Links {
			if l.SpanContext.SpanID() == defers[0].SpanContext.SpanID() {
				linked = true
				require.Equal(t, int64(1), a["caughtup.asynq.woken"].AsInt64())
			}
		}
	}
	require.True(t, linked, "no wake span links to the deferral")
}

// TestTraceApplicationSpanKept: a handler context that already has a span
// (the application's own instrumentation of its workers) stays the
// parent of the routing spans; the task's trace context does not replace
// it.
func TestTraceApplicationSpanKept(t *testing.T) {
	exp, tp := spantest.New(t)
	prop := propagation.TraceContext{}
	e := setup(t, func(c *consume.Config) { c.TracerProvider = tp })
	h, runs := starts()
	appSpans := make(chan trace.SpanContext, 1)
	instrumented := func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			ctx, span := tp.Tracer("app").Start(ctx, "process "+task.Type(), trace.WithSpanKind(trace.SpanKindConsumer))
			defer span.End()
			appSpans <- span.SpanContext()
			return next.ProcessTask(ctx, task)
		})
	}
	mcfg := caughtupasynq.MiddlewareConfig{Redis: e.opt, TracerProvider: tp, Propagators: prop}
	e.serve(t, caughtupasynq.ServerConfig(asynq.Config{}), instrumented(e.middleware(mcfg)(h)))

	// A producer in another trace.
	other, span := tp.Tracer("test").Start(ctxT(t), "producer")
	ctx := e.write(t, other, 2)
	headers := map[string]string{}
	prop.Inject(other, propagation.MapCarrier(headers))
	_, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTaskWithHeaders(ctx, "kept", []byte("2"), headers, asynq.Queue(e.queue)))
	require.NoError(t, err)
	span.End()
	s := nextStart(t, runs, 30*time.Second, "the task")
	require.NoError(t, s.err)
	app := <-appSpans
	var route *tracetest.SpanStub
	waitFor(t, 10*time.Second, func() bool {
		for _, r := range spantest.Named(exp, consume.SpanRoute) {
			if r.SpanContext.TraceID() == app.TraceID() {
				route = &r
				return true
			}
		}
		return false
	}, "no route span in the application's trace")
	require.Equal(t, app.SpanID(), route.Parent.SpanID())
}
