package kafka

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/position"
)

// kgoSpans is franz-go's records as a Client that has spans of its own
// (kotel puts them in Record.Context), for traceContext alone.
type kgoSpans struct {
	Client[*kgo.Record, kgo.RecordHeader]
}

func (kgoSpans) SpanContext(r *kgo.Record) trace.SpanContext {
	if r.Context == nil {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(r.Context)
}

// traceContext: a record joins, in this order, the span of the context
// it is run in, the span its client put on it, the trace context of its
// headers; one whose headers are all token headers, or that has none,
// joins nothing, whatever the propagator.
func TestTraceContext(t *testing.T) {
	t.Parallel()
	span := func(b byte) trace.SpanContext {
		return trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{b, 1}, SpanID: trace.SpanID{b, 2}, TraceFlags: trace.FlagsSampled, Remote: true})
	}
	headers := func(sc trace.SpanContext, others ...kgo.RecordHeader) []kgo.RecordHeader {
		hs := append([]kgo.RecordHeader{{Key: position.HeaderName, Value: []byte("v1;x")}}, others...)
		if sc.IsValid() {
			propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(context.Background(), sc), HeaderCarrier[kgo.RecordHeader]{Headers: &hs})
		}
		return hs
	}
	fromHeaders, fromClient, fromCtx := span(1), span(2), span(3)
	e := &Engine[*kgo.Record, kgo.RecordHeader]{prop: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})}
	withSpans := &Engine[*kgo.Record, kgo.RecordHeader]{prop: e.prop, spans: kgoSpans{}}
	bg := context.Background()
	traced := trace.ContextWithSpanContext(bg, fromCtx)
	for name, c := range map[string]struct {
		e      *Engine[*kgo.Record, kgo.RecordHeader]
		ctx    context.Context
		traced bool
		r      *kgo.Record
		want   trace.SpanContext
	}{
		"headers":                  {e, bg, false, &kgo.Record{Headers: headers(fromHeaders)}, fromHeaders},
		"headers beside another":   {e, bg, false, &kgo.Record{Headers: headers(fromHeaders, kgo.RecordHeader{Key: "k", Value: []byte("v")})}, fromHeaders},
		"token headers only":       {e, bg, false, &kgo.Record{Headers: headers(trace.SpanContext{})}, trace.SpanContext{}},
		"no headers":               {e, bg, false, &kgo.Record{}, trace.SpanContext{}},
		"the client's span":        {withSpans, bg, false, &kgo.Record{Context: trace.ContextWithSpanContext(bg, fromClient), Headers: headers(fromHeaders)}, fromClient},
		"the client without spans": {withSpans, bg, false, &kgo.Record{Headers: headers(fromHeaders)}, fromHeaders},
		"the context's span":       {withSpans, traced, true, &kgo.Record{Context: trace.ContextWithSpanContext(bg, fromClient), Headers: headers(fromHeaders)}, fromCtx},
	} {
		t.Run(name, func(t *testing.T) {
			got := trace.SpanContextFromContext(c.e.traceContext(c.ctx, c.r, &c.r.Headers, c.traced))
			require.True(t, c.want.Equal(got), "joined %v, want %v", got, c.want)
		})
	}
}
