package caughtupkgo_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/spantest"
)

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
	topic := kafkasuite.NewTopics(t, 1, "")[0]
	hook := &fetchSpans{tracer: tp.Tracer("kotel"), spans: make(chan trace.SpanContext, 4)}
	handled := make(chan trace.SpanContext, 4)
	startConsumer(t, caughtupkgo.ConsumerConfig{
		Topic: topic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
		TracerProvider: tp, Propagators: propagation.TraceContext{},
		ClientOpts: []kgo.Opt{kgo.SeedBrokers(kafkasuite.Brokers(t)...), kgo.WithHooks(hook)},
	}, func(ctx context.Context, r *kgo.Record) error {
		handled <- trace.SpanContextFromContext(ctx)
		return nil
	})
	ctx, err := e.Insert(t.Context(), 1, "k", 0)
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
