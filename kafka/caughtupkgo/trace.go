package caughtupkgo

import (
	"context"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/internal/tracing"
	"github.com/caughtup/caughtup/kafka"
)

// HeaderCarrier adapts a record's headers to OpenTelemetry's propagators,
// as franz-go's kotel plugin carries trace context: Get reads the first
// header of a key, Set replaces every header of the key with one.
type HeaderCarrier struct{ Headers *[]kgo.RecordHeader }

var _ propagation.TextMapCarrier = HeaderCarrier{}

// Get returns the value of the first header named key, or "".
func (c HeaderCarrier) Get(key string) string { return kafka.Get(*c.Headers, key) }

// Set replaces the headers named key with one of value.
func (c HeaderCarrier) Set(key, value string) { *c.Headers = kafka.Set(*c.Headers, key, value) }

// Keys returns the header names.
func (c HeaderCarrier) Keys() []string { return kafka.Keys(*c.Headers) }

// stampTrace writes the trace context of ctx into r's headers that are
// not set already, through the global propagators (none until the
// application sets them). r.Headers is replaced, not appended to in place.
func stampTrace(ctx context.Context, r *kgo.Record) {
	if th := kafka.Missing(r.Headers, tracing.Fields(ctx, otel.GetTextMapPropagator())); len(th) > 0 {
		r.Headers = append(r.Headers[:len(r.Headers):len(r.Headers)], th...)
	}
}

// traceContext returns ctx in r's trace: the span franz-go's kotel plugin
// put in r.Context, else the trace context of r's headers, unless ctx has
// a span already.
func (c *Consumer) traceContext(ctx context.Context, r *kgo.Record) context.Context {
	if r.Context != nil {
		if sc := trace.SpanContextFromContext(r.Context); sc.IsValid() && !trace.SpanContextFromContext(ctx).IsValid() {
			return trace.ContextWithSpanContext(ctx, sc)
		}
	}
	return tracing.Continue(ctx, c.prop, HeaderCarrier{&r.Headers})
}
