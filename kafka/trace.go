package kafka

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/tracing"
)

// Span attributes of the consumers' spans, after OpenTelemetry's messaging
// conventions, and caughtup's.
const (
	attrDestination = "messaging.destination.name"
	attrPartition   = "messaging.destination.partition.id"
	attrOffset      = "messaging.kafka.offset"
	attrDeferMode   = "caughtup.kafka.defer"
	attrWoken       = "caughtup.kafka.woken"
)

// Deferral modes on the caughtup.defer span (caughtup.kafka.defer).
const (
	DeferInPlace    = "in_place"
	DeferRetryTopic = "retry_topic"
)

var systemKafka = attribute.String("messaging.system", "kafka")

// RecordAttributes names a record on a span.
func RecordAttributes(topic string, partition int32, offset int64) []attribute.KeyValue {
	return []attribute.KeyValue{systemKafka,
		attribute.String(attrDestination, topic),
		attribute.Int(attrPartition, int(partition)),
		attribute.Int64(attrOffset, offset)}
}

// StartDefer starts the consume.SpanDefer span of a deferral in mode
// (DeferInPlace, DeferRetryTopic), inside ctx's trace only
// (tracing.Start).
func StartDefer(ctx context.Context, tracer trace.Tracer, de *consume.DeferError, mode string, record []attribute.KeyValue) (context.Context, trace.Span) {
	ctx, span := tracing.Start(ctx, tracer, consume.SpanDefer, trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		span.SetAttributes(consume.TraceAttributes(&de.Decision)...)
		span.SetAttributes(record...)
		span.SetAttributes(attribute.String(attrDeferMode, mode))
	}
	return ctx, span
}

// StartWake starts the consume.SpanWake span of a retry-topic record held
// until its due time or its catch-up, inside ctx's trace only.
func StartWake(ctx context.Context, tracer trace.Tracer, record []attribute.KeyValue) (context.Context, trace.Span) {
	return tracing.Start(ctx, tracer, consume.SpanWake, trace.WithAttributes(record...))
}

// EndHold ends a defer or wake span with whether the catch-up ended the
// hold (caughtup.kafka.woken).
func EndHold(span trace.Span, woken bool) {
	span.SetAttributes(attribute.Bool(attrWoken, woken))
	span.End()
}
