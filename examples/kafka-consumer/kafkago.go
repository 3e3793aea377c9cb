package main

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
)

// kafkaGo is segmentio/kafka-go with caughtupkafka: a stamping Writer,
// and a Consumer with a partition reader per assigned partition.
type kafkaGo struct {
	brokers []string
	tr      *kafkago.Transport
	kw      *kafkago.Writer
	w       *caughtupkafka.Writer
}

func newKafkaGo(brokers []string) (client, error) {
	tr := &kafkago.Transport{}
	kw := &kafkago.Writer{
		Addr:         kafkago.TCP(brokers...),
		Balancer:     &kafkago.Hash{},      // one key, one partition: per-key order
		RequiredAcks: kafkago.RequireAll,   // an acknowledged message survives a leader change
		BatchTimeout: 5 * time.Millisecond, // synchronous writes; the default waits 1s
		Transport:    tr,
	}
	return &kafkaGo{brokers: brokers, tr: tr, kw: kw, w: caughtupkafka.NewWriter(kw)}, nil
}

func (k *kafkaGo) createTopics(ctx context.Context, partitions int, topics ...string) error {
	c := &kafkago.Client{Addr: kafkago.TCP(k.brokers...), Transport: k.tr}
	cfgs := make([]kafkago.TopicConfig, len(topics))
	for i, t := range topics {
		cfgs[i] = kafkago.TopicConfig{Topic: t, NumPartitions: partitions, ReplicationFactor: -1} // -1: the brokers' default
	}
	resp, err := c.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: cfgs})
	if err != nil {
		return fmt.Errorf("create topics %v: %w", topics, err)
	}
	for t, err := range resp.Errors {
		if err != nil {
			return fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	for {
		md, err := c.Metadata(ctx, &kafkago.MetadataRequest{Topics: topics})
		if err == nil && len(md.Topics) == len(topics) && !slices.ContainsFunc(md.Topics, func(t kafkago.Topic) bool {
			return len(t.Partitions) != partitions ||
				slices.ContainsFunc(t.Partitions, func(p kafkago.Partition) bool { return p.Leader.Host == "" })
		}) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("topics %v have partitions without a leader: %w", topics, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (k *kafkaGo) consumer(topic string, router *consume.Router, st *stats, logger *slog.Logger, mp metric.MeterProvider) (func(context.Context) error, error) {
	c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
		Brokers:        k.brokers,
		GroupID:        topic + "-group",
		Topic:          topic,
		Router:         router, // required: it gives each message its pool
		Policy:         consume.Delayed,
		Mode:           caughtupkafka.InPlace, // keep per-key order
		CommitInterval: 200 * time.Millisecond,
		MaxWait:        100 * time.Millisecond,
		Logger:         logger,
		MeterProvider:  mp,
	}, func(ctx context.Context, msg kafkago.Message) error { return st.handle(ctx, msg.Key, msg.Value) })
	if err != nil {
		return nil, err
	}
	return c.Run, nil
}

func (k *kafkaGo) produce(ctx context.Context, topic, key string, value []byte) error {
	return k.w.WriteMessages(ctx, kafkago.Message{Topic: topic, Key: []byte(key), Value: value})
}

func (k *kafkaGo) close() {
	_ = k.kw.Close()
	k.tr.CloseIdleConnections()
}
