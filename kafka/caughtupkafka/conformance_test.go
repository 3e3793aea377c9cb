package caughtupkafka_test

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/conformance"
)

// driver runs the conformance suite over one topic (plus its retry and
// dead-letter topics) and one consumer group, so that a second Consume
// continues where the first stopped.
type driver struct {
	t      *testing.T
	mode   caughtupkafka.Mode
	topic  string
	dlt    string
	group  string
	raw    *kafka.Writer
	writer *caughtupkafka.Writer
}

var (
	_ conformance.Driver            = (*driver)(nil)
	_ conformance.RetryCounter      = (*driver)(nil)
	_ conformance.DeadLetterCounter = (*driver)(nil)
)

func newDriver(mode caughtupkafka.Mode) func(t *testing.T) conformance.Driver {
	return func(t *testing.T) conformance.Driver {
		names := newTopics(t, 4, "", ".retry", ".dlt")
		raw := newWriter(t, names[0])
		return &driver{t: t, mode: mode, topic: names[0], dlt: names[2], group: newGroup(t), raw: raw, writer: caughtupkafka.NewWriter(raw)}
	}
}

func jobMessage(job conformance.Job) kafka.Message {
	return kafka.Message{Key: []byte(job.Key), Value: strconv.AppendInt(nil, job.ID, 10)}
}

func (d *driver) Produce(ctx context.Context, job conformance.Job) error {
	return d.writer.WriteMessages(ctx, jobMessage(job))
}

func (d *driver) ProduceRaw(ctx context.Context, job conformance.Job, header string) error {
	msg := jobMessage(job)
	if header != "" {
		msg.Headers = []kafka.Header{{Key: position.HeaderName, Value: []byte(header)}}
	}
	return d.raw.WriteMessages(ctx, msg)
}

func (d *driver) Consume(ctx context.Context, router *consume.Router, policy consume.Policy, handle conformance.Handler) (func() error, error) {
	c, err := caughtupkafka.NewConsumer(testConfig(d.t, caughtupkafka.ConsumerConfig{
		Topic: d.topic, GroupID: d.group, Mode: d.mode, Router: router, Policy: policy,
	}), func(ctx context.Context, msg kafka.Message) error {
		id, err := strconv.ParseInt(string(msg.Value), 10, 64)
		if err != nil {
			return err
		}
		return handle(ctx, conformance.Job{ID: id, Key: string(msg.Key)})
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	r := &running{c: c, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	d.t.Cleanup(func() { _ = r.stop() })
	return r.stop, nil
}

// RetryCount is the handler's failed attempts so far; the suite checks
// that deferrals never count.
func (d *driver) RetryCount(ctx context.Context) int { return caughtupkafka.Attempt(ctx) }

// DeadLettered is how many messages the dead-letter topic holds.
func (d *driver) DeadLettered(ctx context.Context) (int, error) {
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(brokers(d.t)...), Transport: tr, Timeout: 10 * time.Second}
	md, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{d.dlt}})
	if err != nil {
		return 0, err
	}
	if len(md.Topics) != 1 || md.Topics[0].Error != nil {
		return 0, fmt.Errorf("metadata of %s: %+v", d.dlt, md.Topics)
	}
	var reqs []kafka.OffsetRequest
	for _, p := range md.Topics[0].Partitions {
		reqs = append(reqs, kafka.FirstOffsetOf(p.ID), kafka.LastOffsetOf(p.ID))
	}
	resp, err := cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{d.dlt: reqs}})
	if err != nil {
		return 0, err
	}
	n := 0
	for _, po := range resp.Topics[d.dlt] {
		if po.Error != nil {
			return 0, fmt.Errorf("offsets of %s[%d]: %w", d.dlt, po.Partition, po.Error)
		}
		n += int(po.LastOffset - po.FirstOffset)
	}
	return n, nil
}

// TestConformance runs the freshness suite in both modes. The 10,000
// message run with per-key order is TestInPlaceFreshAndOrderedUnderPausedReplay.
func TestConformance(t *testing.T) {
	for _, mode := range []caughtupkafka.Mode{caughtupkafka.InPlace, caughtupkafka.RetryTopic} {
		t.Run(mode.String(), func(t *testing.T) {
			conformance.Run(t, conformance.Config{
				NewDriver: newDriver(mode),
				Jobs:      2000,
				MaxPause:  1500 * time.Millisecond,
				Producers: 16,
				Router: func(c *consume.Config) {
					// The scenarios provoke warnings on purpose.
					c.Logger = slog.New(slog.DiscardHandler)
					c.WaitBudget = 200 * time.Millisecond
					c.DeferInitial = 100 * time.Millisecond
					c.DeferMax = 500 * time.Millisecond
				},
			})
		})
	}
}
