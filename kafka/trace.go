package kafka

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/tracing"
)

// Span attributes of the Engine's spans, after OpenTelemetry's messaging
// conventions, and caughtup's: caughtup.kafka.defer is the Mode of a
// deferral (in_place, retry_topic), caughtup.kafka.woken whether the
// catch-up ended a hold.
const (
	attrDestination = "messaging.destination.name"
	attrPartition   = "messaging.destination.partition.id"
	attrOffset      = "messaging.kafka.offset"
	attrDeferMode   = "caughtup.kafka.defer"
	attrWoken       = "caughtup.kafka.woken"
)

var systemKafka = attribute.String("messaging.system", "kafka")

// traceContext returns ctx in r's trace: unless ctx has a span already,
// the span the client library put on r (SpanContexter), else the trace
// context of r's headers.
func (e *Engine[R, H]) traceContext(ctx context.Context, r R, hs *[]H) context.Context {
	if trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	if e.spans != nil {
		if sc := e.spans.SpanContext(r); sc.IsValid() {
			return trace.ContextWithSpanContext(ctx, sc)
		}
	}
	return e.prop.Extract(ctx, HeaderCarrier[H]{Headers: hs})
}

// recordAttributes names r on a span.
func (e *Engine[R, H]) recordAttributes(r R) []attribute.KeyValue {
	pl := e.lib.Place(r)
	return []attribute.KeyValue{systemKafka,
		attribute.String(attrDestination, pl.Topic),
		attribute.Int(attrPartition, int(pl.Partition)),
		attribute.Int64(attrOffset, pl.Offset)}
}

// startDefer starts the consume.SpanDefer span of r's deferral in mode,
// inside ctx's trace only (tracing.Start).
func (e *Engine[R, H]) startDefer(ctx context.Context, de *consume.DeferError, mode Mode, r R) (context.Context, trace.Span) {
	return consume.StartDefer(ctx, e.tracer, de, func() []attribute.KeyValue {
		return append(e.recordAttributes(r), attribute.String(attrDeferMode, mode.String()))
	})
}

// startWake starts the consume.SpanWake span of a retry-topic record held
// until its due time or its catch-up, inside ctx's trace only.
func (e *Engine[R, H]) startWake(ctx context.Context, r R) (context.Context, trace.Span) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return tracing.Start(ctx, e.tracer, consume.SpanWake)
	}
	return tracing.Start(ctx, e.tracer, consume.SpanWake, trace.WithAttributes(e.recordAttributes(r)...))
}

// endHold ends a defer or wake span with whether the catch-up ended the
// hold.
func endHold(span trace.Span, woken bool) {
	span.SetAttributes(attribute.Bool(attrWoken, woken))
	span.End()
}
