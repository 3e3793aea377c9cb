package caughtupkgo_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/testkit/spantest"
)

// TestTraceDeferral follows a record deferred while every replica is
// paused, in place and through the retry topic: the producer's trace
// context rides in the record's headers (Producer, W3C trace context),
// the consumer's routing spans and its caughtup.defer span join that
// trace, the deferral ends on the catch-up (woken) and the handler's
// context continues the producer's trace.
func TestTraceDeferral(t *testing.T) {
	prop := propagation.TraceContext{}
	before := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(prop) // the Producer injects through the global propagators
	t.Cleanup(func() { otel.SetTextMapPropagator(before) })

	for _, tc := range []struct {
		name     string
		mode     caughtupkgo.Mode
		deferred string // the defer span's mode
		ended    string // the span whose end is the catch-up
	}{
		{"InPlace", caughtupkgo.InPlace, "in_place", consume.SpanDefer},
		{"RetryTopic", caughtupkgo.RetryTopic, "retry_topic", consume.SpanWake},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exp, tp := spantest.New(t)
			e := setupDB(t, func(c *consume.Config) {
				c.TracerProvider = tp
				c.WaitBudget = -1 // defer at once: the in-place hold, not Route's wait
				c.DeferInitial, c.DeferMax, c.MaxAge = time.Minute, time.Minute, 10*time.Minute
			})
			names := newTopics(t, 1, "", ".retry", ".dlt")
			handled := make(chan trace.SpanContext, 4)
			startConsumer(t, caughtupkgo.ConsumerConfig{
				Topic: names[0], Mode: tc.mode, Router: e.router, Policy: consume.Delayed, MeterProvider: e.mp,
				TracerProvider: tp, Propagators: prop,
			}, func(ctx context.Context, r *kgo.Record) error {
				handled <- trace.SpanContextFromContext(ctx)
				return nil
			})
			p := manualProducer(t, names[0])

			e.pauseAll(t)
			reqCtx, req := tp.Tracer("test").Start(t.Context(), "POST /orders")
			ctx, err := e.insert(reqCtx, 1, "k", 0)
			require.NoError(t, err)
			rec := &kgo.Record{Partition: 0, Key: []byte("k"), Value: []byte("traced")}
			require.NoError(t, p.ProduceSync(ctx, rec).FirstErr())
			req.End()
			require.Eventually(t, func() bool { return len(spantest.Named(exp, consume.SpanRoute)) > 0 }, time.Minute, 10*time.Millisecond, "no route span")
			require.Empty(t, handled, "handled while every replica was paused")

			e.resumeAll(t)
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

// TestHeaderCarrier: Set replaces every header of a key with one, Get
// reads the first, and the trace context round-trips through a record.
func TestHeaderCarrier(t *testing.T) {
	t.Parallel()
	hs := []kgo.RecordHeader{{Key: "traceparent", Value: []byte("old")}, {Key: "x", Value: []byte("1")}, {Key: "traceparent", Value: []byte("older")}}
	c := caughtupkgo.HeaderCarrier{Headers: &hs}
	require.Equal(t, "old", c.Get("traceparent"))
	c.Set("traceparent", "new")
	require.Equal(t, []kgo.RecordHeader{{Key: "x", Value: []byte("1")}, {Key: "traceparent", Value: []byte("new")}}, hs)
	require.ElementsMatch(t, []string{"x", "traceparent"}, c.Keys())
	require.Empty(t, c.Get("missing"))

	tp := sdktrace.NewTracerProvider()
	ctx, span := tp.Tracer("test").Start(context.Background(), "produce")
	defer span.End()
	var r kgo.Record
	propagation.TraceContext{}.Inject(ctx, caughtupkgo.HeaderCarrier{Headers: &r.Headers})
	got := propagation.TraceContext{}.Extract(context.Background(), caughtupkgo.HeaderCarrier{Headers: &r.Headers})
	require.Equal(t, span.SpanContext().TraceID(), trace.SpanContextFromContext(got).TraceID())
}

// fetchSpans is a franz-go hook that starts a span per fetched record and
// keeps it in the record's Context, as franz-go's kotel plugin does.
type fetchSpans struct {
	tracer trace.Tracer
	spans  chan trace.SpanContext
}

func (h *fetchSpans) OnFetchRecordBuffered(r *kgo.Record) {
	ctx, span := h.tracer.Start(context.Background(), r.Topic+" receive", trace.WithSpanKind(trace.SpanKindConsumer))
	span.End()
	r.Context = ctx
	h.spans <- span.SpanContext()
}

// TestTraceKotelContext: a record whose Context carries a span (kotel's
// receive span) parents the routing spans and the handler's context, in
// place of the trace context in its headers.
func TestTraceKotelContext(t *testing.T) {
	exp, tp := spantest.New(t)
	e := setupDB(t, func(c *consume.Config) { c.TracerProvider = tp })
	topic := newTopics(t, 1, "")[0]
	hook := &fetchSpans{tracer: tp.Tracer("kotel"), spans: make(chan trace.SpanContext, 4)}
	handled := make(chan trace.SpanContext, 4)
	startConsumer(t, caughtupkgo.ConsumerConfig{
		Topic: topic, Router: e.router, Policy: consume.Delayed, MeterProvider: e.mp,
		TracerProvider: tp, Propagators: propagation.TraceContext{},
		ClientOpts: []kgo.Opt{kgo.SeedBrokers(brokers(t)...), kgo.WithHooks(hook)},
	}, func(ctx context.Context, r *kgo.Record) error {
		handled <- trace.SpanContextFromContext(ctx)
		return nil
	})
	ctx, err := e.insert(t.Context(), 1, "k", 0)
	require.NoError(t, err)
	require.NoError(t, manualProducer(t, topic).ProduceSync(ctx, &kgo.Record{Partition: 0, Value: []byte("x")}).FirstErr())

	var receive trace.SpanContext
	select {
	case receive = <-hook.spans:
	case <-time.After(30 * time.Second):
		t.Fatal("no record fetched")
	}
	select {
	case sc := <-handled:
		require.Equal(t, receive.TraceID(), sc.TraceID(), "the handler is in the receive span's trace")
	case <-time.After(30 * time.Second):
		t.Fatal("the record was not handled")
	}
	routes := spantest.Named(exp, consume.SpanRoute)
	require.NotEmpty(t, routes)
	require.Equal(t, receive.SpanID(), routes[0].Parent.SpanID())
}
