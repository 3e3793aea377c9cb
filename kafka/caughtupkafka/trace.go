package caughtupkafka

import (
	"context"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/kafkarec"
	"github.com/caughtup/caughtup/internal/tracing"
)

// Span attributes, after OpenTelemetry's messaging conventions.
const (
	attrDestination = "messaging.destination.name"
	attrPartition   = "messaging.destination.partition.id"
	attrOffset      = "messaging.kafka.offset"
	attrDeferMode   = "caughtup.kafka.defer"
	attrWoken       = "caughtup.kafka.woken"
)

var systemKafka = attribute.String("messaging.system", "kafka")

// HeaderCarrier adapts a message's headers to OpenTelemetry's propagators,
// the way otel contrib's Kafka instrumentations carry trace context: Get
// reads the first header of a key, Set replaces every header of the key
// with one.
type HeaderCarrier struct{ Headers *[]kafka.Header }

var _ propagation.TextMapCarrier = HeaderCarrier{}

// Get returns the value of the first header named key, or "".
func (c HeaderCarrier) Get(key string) string { return kafkarec.Get(*c.Headers, key) }

// Set replaces the headers named key with one of value.
func (c HeaderCarrier) Set(key, value string) { *c.Headers = kafkarec.Set(*c.Headers, key, value) }

// Keys returns the header names.
func (c HeaderCarrier) Keys() []string { return kafkarec.Keys(*c.Headers) }

// producerTrace is the trace context a producer's messages carry: ctx's,
// through the global propagators (none until the application sets them).
func producerTrace(ctx context.Context) map[string]string {
	return tracing.Fields(ctx, otel.GetTextMapPropagator())
}

// messageAttributes names msg on a span.
func messageAttributes(msg *kafka.Message) []attribute.KeyValue {
	return []attribute.KeyValue{systemKafka,
		attribute.String(attrDestination, msg.Topic),
		attribute.Int(attrPartition, msg.Partition),
		attribute.Int64(attrOffset, msg.Offset)}
}

// startDefer starts the caughtup.defer span of a deferral of msg, in
// mode ("in_place", "retry_topic").
func (c *Consumer) startDefer(ctx context.Context, msg *kafka.Message, de *consume.DeferError, mode string) (context.Context, trace.Span) {
	ctx, span := tracing.Start(ctx, c.tracer, consume.SpanDefer, trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		span.SetAttributes(consume.TraceAttributes(&de.Decision)...)
		span.SetAttributes(messageAttributes(msg)...)
		span.SetAttributes(attribute.String(attrDeferMode, mode))
	}
	return ctx, span
}
