package main

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
)

// franzGo is franz-go with caughtupkgo: a stamping Producer over one
// client, and a Consumer with a group client of its own that pauses a
// partition while its head record waits.
type franzGo struct {
	brokers []string
	cl      *kgo.Client
	p       *caughtupkgo.Producer
}

func newFranzGo(brokers []string) (client, error) {
	// franz-go's defaults suit tokens: a key stays on one partition, acks
	// come from all in-sync replicas.
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return nil, err
	}
	return &franzGo{brokers: brokers, cl: cl, p: caughtupkgo.NewProducer(cl)}, nil
}

func (f *franzGo) createTopics(ctx context.Context, partitions int, topics ...string) error {
	req := kmsg.NewPtrCreateTopicsRequest()
	req.TimeoutMillis = 10000
	for _, t := range topics {
		rt := kmsg.NewCreateTopicsRequestTopic()
		rt.Topic, rt.NumPartitions, rt.ReplicationFactor = t, int32(partitions), -1 // -1: the brokers' default
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(ctx, f.cl)
	if err != nil {
		return fmt.Errorf("create topics %v: %w", topics, err)
	}
	for _, rt := range resp.Topics {
		if err := kerr.ErrorForCode(rt.ErrorCode); err != nil {
			return fmt.Errorf("create topic %s: %w", rt.Topic, err)
		}
	}
	for {
		md := kmsg.NewPtrMetadataRequest()
		for _, t := range topics {
			mt := kmsg.NewMetadataRequestTopic()
			mt.Topic = kmsg.StringPtr(t)
			md.Topics = append(md.Topics, mt)
		}
		resp, err := md.RequestWith(ctx, f.cl)
		if err == nil && len(resp.Topics) == len(topics) && !slices.ContainsFunc(resp.Topics, func(t kmsg.MetadataResponseTopic) bool {
			return t.ErrorCode != 0 || len(t.Partitions) != partitions ||
				slices.ContainsFunc(t.Partitions, func(p kmsg.MetadataResponseTopicPartition) bool { return p.Leader < 0 })
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

func (f *franzGo) consumer(topic string, router *consume.Router, st *stats, logger *slog.Logger, mp metric.MeterProvider) (func(context.Context) error, error) {
	c, err := caughtupkgo.NewConsumer(caughtupkgo.ConsumerConfig{
		ClientOpts: []kgo.Opt{
			kgo.SeedBrokers(f.brokers...),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), // the records produced before the group joined
			kgo.FetchMaxWait(100 * time.Millisecond),          // a resumed partition waits at most this for a fetch
		},
		GroupID:        topic + "-group",
		Topic:          topic,
		Router:         router, // required: it gives each record its pool
		Policy:         consume.Delayed,
		Mode:           caughtupkgo.InPlace, // keep per-key order: pause the partition while its head waits
		CommitInterval: 200 * time.Millisecond,
		Logger:         logger,
		MeterProvider:  mp,
	}, func(ctx context.Context, r *kgo.Record) error { return st.handle(ctx, r.Key, r.Value) })
	if err != nil {
		return nil, err
	}
	return c.Run, nil
}

func (f *franzGo) produce(ctx context.Context, topic, key string, value []byte) error {
	return f.p.ProduceSync(ctx, &kgo.Record{Topic: topic, Key: []byte(key), Value: value}).FirstErr()
}

func (f *franzGo) close() { f.cl.Close() }
