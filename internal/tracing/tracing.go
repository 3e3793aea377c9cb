// Package tracing is what the adapters share about trace context: a job
// carries its producer's trace context in its headers, through the
// application's propagators (W3C trace context and baggage with
// otel.SetTextMapPropagator), and its consumer continues that trace unless
// the application's own instrumentation already started a span for it.
package tracing

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Continue returns ctx with the trace context carrier holds, unless ctx
// already has a span: a consumer instrumented by the application (a span
// per task or message of its own) keeps its span as the parent of
// caughtup's, and one that is not continues the producer's trace.
func Continue(ctx context.Context, prop propagation.TextMapPropagator, carrier propagation.TextMapCarrier) context.Context {
	if trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	return prop.Extract(ctx, carrier)
}

// Fields returns the trace context of ctx as prop writes it, or nil when
// there is none to carry (no span, or no propagator set: otel's global
// default propagates nothing).
func Fields(ctx context.Context, prop propagation.TextMapPropagator) map[string]string {
	if len(prop.Fields()) == 0 || !trace.SpanContextFromContext(ctx).IsValid() {
		return nil
	}
	c := propagation.MapCarrier{}
	prop.Inject(ctx, c)
	return c
}
