// Package tracing is what the router and the adapters share about traces:
// a job carries its producer's trace context in its headers, through the
// application's propagators (W3C trace context and baggage with
// otel.SetTextMapPropagator), its consumer continues that trace unless the
// application's own instrumentation already started a span for it, and
// caughtup's spans join a trace but never start one (Start).
package tracing

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
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

// Start starts a span of caughtup's as a child of ctx's span, or starts
// none when ctx has no span: caughtup's spans annotate the application's
// traces (the producer's, continued from the job's headers, or the
// consumer's own), they never start one. A job outside any trace then
// costs one context lookup rather than a span, and a sampler is not asked
// to keep a one-span trace per job. The span returned without a parent is
// a no-op.
func Start(ctx context.Context, tracer trace.Tracer, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ctx, noop.Span{}
	}
	return tracer.Start(ctx, name, opts...)
}
