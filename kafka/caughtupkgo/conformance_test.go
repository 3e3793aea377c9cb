package caughtupkgo_test

import (
	"context"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/conformance"
)

// driver runs the conformance suite over one topic (plus its retry and
// dead-letter topics) and one consumer group, so that a second Consume
// continues where the first stopped.
type driver struct {
	t      *testing.T
	mode   caughtupkgo.Mode
	topic  string
	dlt    string
	group  string
	raw    *kgo.Client
	stamps *caughtupkgo.Producer
}

var (
	_ conformance.Driver            = (*driver)(nil)
	_ conformance.RetryCounter      = (*driver)(nil)
	_ conformance.DeadLetterCounter = (*driver)(nil)
)

func newDriver(mode caughtupkgo.Mode) func(t *testing.T) conformance.Driver {
	return func(t *testing.T) conformance.Driver {
		names := newTopics(t, 4, "", ".retry", ".dlt")
		raw := newClient(t, kgo.DefaultProduceTopic(names[0]), kgo.ProducerLinger(0))
		return &driver{t: t, mode: mode, topic: names[0], dlt: names[2], group: newGroup(t), raw: raw, stamps: caughtupkgo.NewProducer(raw)}
	}
}

func jobRecord(job conformance.Job) *kgo.Record {
	return &kgo.Record{Key: []byte(job.Key), Value: strconv.AppendInt(nil, job.ID, 10)}
}

func (d *driver) Produce(ctx context.Context, job conformance.Job) error {
	return d.stamps.ProduceSync(ctx, jobRecord(job)).FirstErr()
}

func (d *driver) ProduceRaw(ctx context.Context, job conformance.Job, header string) error {
	r := jobRecord(job)
	if header != "" {
		r.Headers = []kgo.RecordHeader{{Key: position.HeaderName, Value: []byte(header)}}
	}
	return d.raw.ProduceSync(ctx, r).FirstErr()
}

func (d *driver) Consume(ctx context.Context, router *consume.Router, policy consume.Policy, handle conformance.Handler) (func() error, error) {
	c, err := caughtupkgo.NewConsumer(testConfig(d.t, caughtupkgo.ConsumerConfig{
		Topic: d.topic, GroupID: d.group, Mode: d.mode, Router: router, Policy: policy,
	}), func(ctx context.Context, r *kgo.Record) error {
		id, err := strconv.ParseInt(string(r.Value), 10, 64)
		if err != nil {
			return err
		}
		return handle(ctx, conformance.Job{ID: id, Key: string(r.Key)})
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
func (d *driver) RetryCount(ctx context.Context) int { return caughtupkgo.Attempt(ctx) }

// DeadLettered is how many records the dead-letter topic holds.
func (d *driver) DeadLettered(ctx context.Context) (int, error) {
	return countRecords(ctx, d.t, d.dlt)
}

// TestConformance runs the freshness suite in both modes.
func TestConformance(t *testing.T) {
	for _, mode := range []caughtupkgo.Mode{caughtupkgo.InPlace, caughtupkgo.RetryTopic} {
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
				OnReport: func(r conformance.Report) { t.Logf("%s: %s", r.Scenario, r) },
			})
		})
	}
}
