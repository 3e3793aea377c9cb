package kafkasuite

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka"
)

// Client drives one Kafka adapter for the shared tests: its consumer, its
// stamping producer and a raw one. An adapter's test package implements it
// over its client library; NewClient makes one per test.
type Client interface {
	// Consume runs the adapter's Consumer on c, with the quick fetches,
	// commits and retry backoff of the adapter's own tests, calling h for
	// each record, until stop is called or the test ends. stop returns
	// once Run has.
	Consume(c Consumer, h Handler) (stop func() error)
	// Produce writes a record to topic through the adapter's stamper:
	// ctx's token and trace context in its headers. It returns once the
	// broker has acknowledged it.
	Produce(ctx context.Context, topic string, key, value []byte) error
	// ProduceRaw writes a record whose only token header has the value
	// header ("" for none), bypassing stamping.
	ProduceRaw(ctx context.Context, topic string, key, value []byte, header string) error
	// Attempt is the adapter's Attempt: the failed attempts before the
	// run of the record handled in ctx.
	Attempt(ctx context.Context) int
}

// NewClient returns a Client for one test, closed at its cleanup.
type NewClient func(t testing.TB) Client

// Consumer is a test consumer's config: the fields both adapters'
// ConsumerConfigs share. GroupID "" is a new group (NewGroup).
type Consumer struct {
	Topic          string
	GroupID        string
	Mode           kafka.Mode
	Router         *consume.Router
	Policy         consume.Policy
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
	Propagators    propagation.TextMapPropagator
}

// Record is what the shared tests' handlers see of a record.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
}

// Handler handles a record in the shared tests.
type Handler func(ctx context.Context, r Record) error
