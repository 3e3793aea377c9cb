package caughtupkafka

import (
	"context"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/caughtup/caughtup/internal/tracing"
	engine "github.com/caughtup/caughtup/kafka"
)

// HeaderCarrier adapts a message's headers to OpenTelemetry's propagators,
// the way otel contrib's Kafka instrumentations carry trace context: Get
// reads the first header of a key, Set replaces every header of the key
// with one.
type HeaderCarrier struct{ Headers *[]kafka.Header }

var _ propagation.TextMapCarrier = HeaderCarrier{}

// Get returns the value of the first header named key, or "".
func (c HeaderCarrier) Get(key string) string { return engine.Get(*c.Headers, key) }

// Set replaces the headers named key with one of value.
func (c HeaderCarrier) Set(key, value string) { *c.Headers = engine.Set(*c.Headers, key, value) }

// Keys returns the header names.
func (c HeaderCarrier) Keys() []string { return engine.Keys(*c.Headers) }

// producerTrace is the trace context a producer's messages carry: ctx's,
// through the global propagators (none until the application sets them).
func producerTrace(ctx context.Context) map[string]string {
	return tracing.Fields(ctx, otel.GetTextMapPropagator())
}
