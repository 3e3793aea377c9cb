// Package spantest records spans in memory and reads them back, for the
// tests of the packages that make spans.
//
//	exp, tp := spantest.New(t)
//	// … hand tp to the code under test, run it …
//	routes := spantest.Named(exp, consume.SpanRoute)
//	outcome := spantest.Attrs(routes[0])["caughtup.outcome"].AsString()
package spantest

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// New returns an in-memory exporter and a TracerProvider that exports
// every span to it as it ends, shut down when the test ends.
func New(t testing.TB) (*tracetest.InMemoryExporter, *sdktrace.TracerProvider) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return exp, tp
}

// Named returns the ended spans called name, in the order they ended.
func Named(exp *tracetest.InMemoryExporter, name string) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// Attrs returns a span's attributes by key.
func Attrs(s tracetest.SpanStub) map[string]attribute.Value {
	m := make(map[string]attribute.Value, len(s.Attributes))
	for _, kv := range s.Attributes {
		m[string(kv.Key)] = kv.Value
	}
	return m
}
