package kafkasuite

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/testkit/spantest"
)

// TraceDeferral follows a record deferred while every replica is paused,
// in place and through the retry topic: the producer's trace context
// rides in the record's headers (the adapter's stamper, W3C trace
// context), the consumer's routing spans and its caughtup.defer span join
// that trace, the deferral ends on the catch-up (woken) and the handler's
// context continues the producer's trace. It sets the global propagator
// for its duration: do not run it in parallel.
func TraceDeferral(t *testing.T, newClient NewClient) {
	prop := propagation.TraceContext{}
	before := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(prop) // the stampers inject through the global propagators
	t.Cleanup(func() { otel.SetTextMapPropagator(before) })

	for _, tc := range []struct {
		name     string
		mode     kafka.Mode
		deferred string // the defer span's mode
		ended    string // the span whose end is the catch-up
	}{
		{"InPlace", kafka.InPlace, "in_place", consume.SpanDefer},
		{"RetryTopic", kafka.RetryTopic, "retry_topic", consume.SpanWake},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exp, tp := spantest.New(t)
			e := SetupDB(t, func(c *consume.Config) {
				c.TracerProvider = tp
				c.WaitBudget = -1 // defer at once: the in-place hold, not Route's wait
				c.DeferInitial, c.DeferMax, c.MaxAge = time.Minute, time.Minute, 10*time.Minute
			})
			names := NewTopics(t, 1, "", ".retry", ".dlt")
			cl := newClient(t)
			handled := make(chan trace.SpanContext, 4)
			cl.Consume(Consumer{
				Topic: names[0], Mode: tc.mode, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
				TracerProvider: tp, Propagators: prop,
			}, func(ctx context.Context, _ Record) error {
				handled <- trace.SpanContextFromContext(ctx)
				return nil
			})

			e.PauseAll(t)
			reqCtx, req := tp.Tracer("test").Start(t.Context(), "POST /orders")
			ctx, err := e.Insert(reqCtx, 1, "k", 0)
			require.NoError(t, err)
			require.NoError(t, cl.Produce(ctx, names[0], []byte("k"), []byte("traced")))
			req.End()
			require.Eventually(t, func() bool { return len(spantest.Named(exp, consume.SpanRoute)) > 0 }, time.Minute, 10*time.Millisecond, "no route span")
			require.Empty(t, handled, "handled while every replica was paused")

			e.ResumeAll(t)
			select {
			case sc := <-handled:
				require.Equal(t, req.SpanContext().TraceID(), sc.TraceID(), "the handler continues the producer's trace")
			case <-time.After(30 * time.Second):
				t.Fatal("the deferred record did not run within 30s of the resume; its deferral is a minute")
			}

			reqTrace := req.SpanContext().TraceID()
			routes := spantest.Named(exp, consume.SpanRoute)
			require.GreaterOrEqual(t, len(routes), 2)
			require.Equal(t, "defer", spantest.Attrs(routes[0])["caughtup.action"].AsString())
			last := spantest.Attrs(routes[len(routes)-1])
			require.Equal(t, "run", last["caughtup.action"].AsString())
			require.Equal(t, "replica", last["caughtup.outcome"].AsString())
			for _, r := range routes {
				require.Equal(t, reqTrace, r.SpanContext.TraceID())
			}
			defers := spantest.Named(exp, consume.SpanDefer)
			require.Len(t, defers, 1)
			d := spantest.Attrs(defers[0])
			require.Equal(t, reqTrace, defers[0].SpanContext.TraceID())
			require.Equal(t, tc.deferred, d["caughtup.kafka.defer"].AsString())
			require.Equal(t, "kafka", d["messaging.system"].AsString())
			require.Equal(t, names[0], d["messaging.destination.name"].AsString())
			require.Equal(t, "replica_behind", d["caughtup.reason"].AsString())
			woke := spantest.Named(exp, tc.ended)
			require.NotEmpty(t, woke)
			require.True(t, spantest.Attrs(woke[len(woke)-1])["caughtup.kafka.woken"].AsBool(), "the catch-up ended the deferral")
			require.Equal(t, reqTrace, woke[len(woke)-1].SpanContext.TraceID())
		})
	}
}
