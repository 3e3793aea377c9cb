package kafkasuite

import (
	"context"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/testkit/conformance"
)

// Conformance runs the freshness suite (testkit/conformance) on the
// adapter in both modes, over a topic of 4 partitions (plus its retry and
// dead-letter topics) and one consumer group per scenario, so that a
// second Consume continues where the first stopped.
func Conformance(t *testing.T, newClient NewClient) {
	for _, mode := range []kafka.Mode{kafka.InPlace, kafka.RetryTopic} {
		t.Run(mode.String(), func(t *testing.T) {
			conformance.Run(t, conformance.Config{
				NewDriver: func(t *testing.T) conformance.Driver {
					names := NewTopics(t, 4, "", ".retry", ".dlt")
					return &driver{t: t, c: newClient(t), mode: mode, topic: names[0], dlt: names[2], group: NewGroup(t)}
				},
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

// driver is a conformance.Driver over a Client.
type driver struct {
	t     *testing.T
	c     Client
	mode  kafka.Mode
	topic string
	dlt   string
	group string
}

var (
	_ conformance.Driver            = (*driver)(nil)
	_ conformance.RetryCounter      = (*driver)(nil)
	_ conformance.DeadLetterCounter = (*driver)(nil)
)

func (d *driver) Produce(ctx context.Context, job conformance.Job) error {
	return d.c.Produce(ctx, d.topic, []byte(job.Key), strconv.AppendInt(nil, job.ID, 10))
}

func (d *driver) ProduceRaw(ctx context.Context, job conformance.Job, header string) error {
	return d.c.ProduceRaw(ctx, d.topic, []byte(job.Key), strconv.AppendInt(nil, job.ID, 10), header)
}

func (d *driver) Consume(ctx context.Context, router *consume.Router, policy consume.Policy, handle conformance.Handler) (func() error, error) {
	stop := d.c.Consume(Consumer{Topic: d.topic, GroupID: d.group, Mode: d.mode, Router: router, Policy: policy},
		func(ctx context.Context, r Record) error {
			id, err := strconv.ParseInt(string(r.Value), 10, 64)
			if err != nil {
				return err
			}
			return handle(ctx, conformance.Job{ID: id, Key: string(r.Key)})
		})
	return stop, nil
}

// RetryCount is the handler's failed attempts so far; the suite checks
// that deferrals never count.
func (d *driver) RetryCount(ctx context.Context) int { return d.c.Attempt(ctx) }

// DeadLettered is how many records the dead-letter topic holds.
func (d *driver) DeadLettered(ctx context.Context) (int, error) {
	return CountRecords(ctx, d.t, d.dlt)
}
