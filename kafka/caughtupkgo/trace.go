package caughtupkgo

import (
	"context"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"

	"github.com/caughtup/caughtup/internal/tracing"
	"github.com/caughtup/caughtup/kafka"
)

// HeaderCarrier adapts a record's headers to OpenTelemetry's propagators
// (kafka.HeaderCarrier), as franz-go's kotel plugin carries trace context:
// Get reads the first header of a key, Set replaces every header of the
// key with one.
type HeaderCarrier = kafka.HeaderCarrier[kgo.RecordHeader]

// stampTrace writes the trace context of ctx into r's headers that are
// not set already, through the global propagators (none until the
// application sets them). r.Headers is replaced, not appended to in place.
func stampTrace(ctx context.Context, r *kgo.Record) {
	if th := kafka.MissingHeaders(r.Headers, tracing.Fields(ctx, otel.GetTextMapPropagator())); len(th) > 0 {
		r.Headers = append(r.Headers[:len(r.Headers):len(r.Headers)], th...)
	}
}
