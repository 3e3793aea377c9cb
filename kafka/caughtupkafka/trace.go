package caughtupkafka

import (
	"context"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"

	"github.com/caughtup/caughtup/internal/tracing"
	engine "github.com/caughtup/caughtup/kafka"
)

// HeaderCarrier adapts a message's headers to OpenTelemetry's propagators
// (engine.HeaderCarrier): Get reads the first header of a key, Set
// replaces every header of the key with one.
type HeaderCarrier = engine.HeaderCarrier[kafka.Header]

// producerTrace is the trace context a producer's messages carry: ctx's,
// through the global propagators (none until the application sets them).
func producerTrace(ctx context.Context) map[string]string {
	return tracing.Fields(ctx, otel.GetTextMapPropagator())
}
