package caughtupkgo

import (
	"context"
	"errors"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/kafka"
)

// client is franz-go as the engine uses it: the records of the current
// Run's client, and produces through it.
type client struct{ c *Consumer }

var (
	_ kafka.Client[*kgo.Record, kgo.RecordHeader] = client{}
	_ kafka.SpanContexter[*kgo.Record]            = client{}
)

func (client) Place(r *kgo.Record) kafka.Place {
	return kafka.Place{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, LeaderEpoch: r.LeaderEpoch}
}

func (client) Headers(r *kgo.Record) *[]kgo.RecordHeader { return &r.Headers }

// SpanContext is the span franz-go's kotel plugin put in r.Context.
func (client) SpanContext(r *kgo.Record) trace.SpanContext {
	if r.Context == nil {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(r.Context)
}

// errNotRunning is Produce's error outside Run.
var errNotRunning = errors.New("caughtup/kgo: the consumer is not running")

// Produce produces a new record each time: a record that failed cannot be
// produced again as it is, since franz-go keeps its partition and producer
// state on it.
func (cl client) Produce(ctx context.Context, topic string, r *kgo.Record, hs []kgo.RecordHeader) error {
	c := cl.c.client.Load()
	if c == nil {
		return errNotRunning
	}
	return c.ProduceSync(ctx, &kgo.Record{Topic: topic, Key: r.Key, Value: r.Value, Headers: hs}).FirstErr()
}
