package caughtupkafka_test

import (
	"context"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// suiteClient drives caughtupkafka for the tests both Kafka adapters
// share (testkit/kafkasuite).
type suiteClient struct {
	t   testing.TB
	raw *kafka.Writer
	w   *caughtupkafka.Writer
}

var _ kafkasuite.Client = (*suiteClient)(nil)

func newSuiteClient(t testing.TB) kafkasuite.Client {
	raw := newWriter(t, "")
	return &suiteClient{t: t, raw: raw, w: caughtupkafka.NewWriter(raw)}
}

func (c *suiteClient) Consume(sc kafkasuite.Consumer, h kafkasuite.Handler) func() error {
	r := startConsumer(c.t, caughtupkafka.ConsumerConfig{
		Topic: sc.Topic, GroupID: sc.GroupID, Mode: sc.Mode, Router: sc.Router, Policy: sc.Policy,
		MeterProvider: sc.MeterProvider, TracerProvider: sc.TracerProvider, Propagators: sc.Propagators,
	}, func(ctx context.Context, msg kafka.Message) error {
		return h(ctx, kafkasuite.Record{Topic: msg.Topic, Partition: int32(msg.Partition), Offset: msg.Offset, Key: msg.Key, Value: msg.Value})
	})
	return r.Stop
}

func (c *suiteClient) Produce(ctx context.Context, topic string, key, value []byte) error {
	return c.w.WriteMessages(ctx, kafka.Message{Topic: topic, Key: key, Value: value})
}

func (c *suiteClient) ProduceRaw(ctx context.Context, topic string, key, value []byte, header string) error {
	msg := kafka.Message{Topic: topic, Key: key, Value: value}
	if header != "" {
		msg.Headers = []kafka.Header{{Key: position.HeaderName, Value: []byte(header)}}
	}
	return c.raw.WriteMessages(ctx, msg)
}

func (*suiteClient) Attempt(ctx context.Context) int { return caughtupkafka.Attempt(ctx) }

// TestConformance runs the freshness suite in both modes. The 10,000
// message run with per-key order is TestInPlaceFreshAndOrderedUnderPausedReplay.
func TestConformance(t *testing.T) { kafkasuite.Conformance(t, newSuiteClient) }

func TestTraceDeferral(t *testing.T) { kafkasuite.TraceDeferral(t, newSuiteClient) }
