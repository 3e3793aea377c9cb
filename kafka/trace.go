package kafka

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/tracing"
	"github.com/caughtup/caughtup/position"
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

// traceContext returns ctx in r's trace: unless ctx has a span already
// (traced, which the caller knows of its ctx), the span the client
// library put on r (SpanContexter), else the trace context of r's
// headers. A record whose headers are all token headers carries no trace
// context: the propagator is not asked (with OpenTelemetry's global
// propagator that is a lock and an unlock per record, about 40 ns of the
// 650 a record cost in BenchmarkThroughput).
func (e *Engine[R, H]) traceContext(ctx context.Context, r R, hs *[]H, traced bool) context.Context {
	if traced {
		return ctx
	}
	if e.spans != nil {
		if sc := e.spans.SpanContext(r); sc.IsValid() {
			return trace.ContextWithSpanContext(ctx, sc)
		}
	}
	if onlyTokenHeaders(*hs) {
		return ctx
	}
	return e.prop.Extract(ctx, HeaderCarrier[H]{Headers: hs})
}

// onlyTokenHeaders reports whether every header of hs is a
// position.HeaderName header (or there are none).
func onlyTokenHeaders[H Header](hs []H) bool {
	for i := range hs {
		if raw(hs[i]).Key != position.HeaderName {
			return false
		}
	}
	return true
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
