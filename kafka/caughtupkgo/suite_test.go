package caughtupkgo_test

import (
	"context"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// suiteClient drives caughtupkgo for the tests both Kafka adapters share
// (testkit/kafkasuite).
type suiteClient struct {
	t      testing.TB
	raw    *kgo.Client
	stamps *caughtupkgo.Producer
}

var _ kafkasuite.Client = (*suiteClient)(nil)

func newSuiteClient(t testing.TB) kafkasuite.Client {
	raw := newClient(t, kgo.ProducerLinger(0))
	return &suiteClient{t: t, raw: raw, stamps: caughtupkgo.NewProducer(raw)}
}

func (c *suiteClient) Consume(sc kafkasuite.Consumer, h kafkasuite.Handler) func() error {
	r := startConsumer(c.t, caughtupkgo.ConsumerConfig{
		Topic: sc.Topic, GroupID: sc.GroupID, Mode: sc.Mode, Router: sc.Router, Policy: sc.Policy,
		MeterProvider: sc.MeterProvider, TracerProvider: sc.TracerProvider, Propagators: sc.Propagators,
	}, func(ctx context.Context, r *kgo.Record) error {
		return h(ctx, kafkasuite.Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value})
	})
	return r.Stop
}

func (c *suiteClient) Produce(ctx context.Context, topic string, key, value []byte) error {
	return c.stamps.ProduceSync(ctx, &kgo.Record{Topic: topic, Key: key, Value: value}).FirstErr()
}

func (c *suiteClient) ProduceRaw(ctx context.Context, topic string, key, value []byte, header string) error {
	r := &kgo.Record{Topic: topic, Key: key, Value: value}
	if header != "" {
		r.Headers = []kgo.RecordHeader{{Key: position.HeaderName, Value: []byte(header)}}
	}
	return c.raw.ProduceSync(ctx, r).FirstErr()
}

func (*suiteClient) Attempt(ctx context.Context) int { return caughtupkgo.Attempt(ctx) }

// TestConformance runs the freshness suite in both modes.
func TestConformance(t *testing.T) { kafkasuite.Conformance(t, newSuiteClient) }

func TestTraceDeferral(t *testing.T) { kafkasuite.TraceDeferral(t, newSuiteClient) }
