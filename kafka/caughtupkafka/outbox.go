package caughtupkafka

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/outbox"
)

// OutboxPublisher publishes outbox events with a kafka-go Writer, for
// outbox.PollingRelay and outbox.LogicalRelay: topic = Event.Topic (unless
// the writer has a fixed Topic), key = Event.Key, value = Event.Payload,
// and every header, including the token (position.HeaderName) and the
// event ID (outbox.HeaderEventID) the relay stamped. It adds no token of
// its own: the relay's, at or past the row's commit, is the one that
// counts, and the relay has already merged it with the producer's by the
// one header rule. Consumers read it as any stamped message's.
type OutboxPublisher struct {
	w *kafka.Writer
}

var _ outbox.Publisher = (*OutboxPublisher)(nil)

// ErrUnsafeWriter is returned by NewOutboxPublisher for a writer that does
// not wait for the broker's acknowledgement, so a relay would mark events
// done that may never have been stored.
var ErrUnsafeWriter = errors.New("caughtup/kafka: an outbox publisher needs a synchronous kafka.Writer (Async false) with RequiredAcks RequireOne or RequireAll")

// NewOutboxPublisher wraps w. It refuses an Async writer and RequiredAcks
// RequireNone (kafka-go's default): both return before the broker has the
// messages. Use a hash balancer (kafka.Hash) to keep per-key order, and a
// short BatchTimeout: each publish waits for its batch to fill or time
// out. It does not take ownership of w: close it yourself.
func NewOutboxPublisher(w *kafka.Writer) (*OutboxPublisher, error) {
	if w == nil {
		return nil, errors.New("caughtup/kafka: NewOutboxPublisher: nil writer")
	}
	if w.Async || w.RequiredAcks == kafka.RequireNone {
		return nil, ErrUnsafeWriter
	}
	return &OutboxPublisher{w: w}, nil
}

// Publish writes the batch in one WriteMessages call and returns its
// error; on a partial failure the relay republishes the whole batch
// (consumers dedupe on outbox.HeaderEventID).
func (p *OutboxPublisher) Publish(ctx context.Context, events []outbox.Event) error {
	if len(events) == 0 {
		return nil
	}
	msgs := make([]kafka.Message, len(events))
	for i, ev := range events {
		m := kafka.Message{Key: ev.Key, Value: ev.Payload, Headers: outboxHeaders(ev.Headers)}
		if p.w.Topic == "" {
			m.Topic = ev.Topic
		}
		msgs[i] = m
	}
	if err := p.w.WriteMessages(ctx, msgs...); err != nil {
		return fmt.Errorf("caughtup/kafka: outbox publish of %d events: %w", len(events), err)
	}
	return nil
}

// outboxHeaders sorts by key so that identical events produce identical
// messages (maps iterate in random order).
func outboxHeaders(h map[string]string) []kafka.Header {
	if len(h) == 0 {
		return nil
	}
	keys := slices.Sorted(maps.Keys(h))
	out := make([]kafka.Header, len(keys))
	for i, k := range keys {
		out[i] = kafka.Header{Key: k, Value: []byte(h[k])}
	}
	return out
}
