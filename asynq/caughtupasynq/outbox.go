package caughtupasynq

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/outbox"
)

// OutboxPublisher enqueues outbox events as asynq tasks, for
// outbox.PollingRelay and outbox.LogicalRelay: type = Event.Topic,
// payload = Event.Payload, headers as the relay stamped them (the token
// in position.HeaderName, the event ID in outbox.HeaderEventID), and
// TaskID = Event.ID, so that a batch published twice enqueues each task
// once. It adds no token of its own: the relay's, at or past the row's
// commit, is the one that counts. The Middleware routes these tasks like
// any stamped task.
type OutboxPublisher struct {
	c    *asynq.Client
	opts []asynq.Option
}

var _ outbox.Publisher = (*OutboxPublisher)(nil)

// NewOutboxPublisher wraps c; opts (queue, retention, …) apply to every
// task. asynq rejects a reused TaskID only while the task is still in
// Redis: add asynq.Retention so that completed tasks keep deduplicating
// republished events for as long as a relay might resend them. It does
// not take ownership of c: close it yourself.
func NewOutboxPublisher(c *asynq.Client, opts ...asynq.Option) (*OutboxPublisher, error) {
	if c == nil {
		return nil, errors.New("caughtup/asynq: NewOutboxPublisher: nil client")
	}
	return &OutboxPublisher{c: c, opts: slices.Clone(opts)}, nil
}

// Publish enqueues the events one by one (asynq has no batch enqueue). An
// asynq.ErrTaskIDConflict means an earlier attempt already enqueued the
// event, with a token that also covers its commit, and counts as success.
func (p *OutboxPublisher) Publish(ctx context.Context, events []outbox.Event) error {
	for _, ev := range events {
		opts := p.opts
		if ev.ID != "" {
			opts = append(slices.Clip(p.opts), asynq.TaskID(ev.ID))
		}
		task := asynq.NewTaskWithHeaders(ev.Topic, ev.Payload, ev.Headers, opts...)
		if _, err := p.c.EnqueueContext(ctx, task); err != nil && !errors.Is(err, asynq.ErrTaskIDConflict) {
			return fmt.Errorf("caughtup/asynq: outbox enqueue of event %s (%s): %w", ev.ID, ev.Topic, err)
		}
	}
	return nil
}
