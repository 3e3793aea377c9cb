package outbox

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/hibiken/asynq"
	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/position"
)

// Publisher delivers a batch of stamped events. Relays call it with the
// events of one batch in Seq order and mark the batch done only when it
// returns nil, so Publish must return nil only once every event is
// durably accepted by the broker. An error makes the relay publish the
// whole batch again later: duplicates, never loss. The relay reuses the
// slice after Publish returns; copy events that must outlive the call.
type Publisher interface {
	Publish(ctx context.Context, events []Event) error
}

// PublisherFunc adapts a function to Publisher.
type PublisherFunc func(ctx context.Context, events []Event) error

// Publish calls f.
func (f PublisherFunc) Publish(ctx context.Context, events []Event) error { return f(ctx, events) }

var _ Publisher = PublisherFunc(nil)

// stamper stamps the events of one batch with one token, encoded once.
type stamper struct {
	tok position.Token
	enc string
}

func newStamper(tok position.Token) stamper {
	enc, _ := tok.Encode()
	return stamper{tok: tok, enc: enc}
}

// stamp returns ev with the token merged into any token the producer put
// in its headers, and the token and event ID headers set. The headers map
// is copied: the caller's event, and a retried batch, are never changed in
// place.
func (s stamper) stamp(ev Event) Event {
	h := make(map[string]string, len(ev.Headers)+2)
	maps.Copy(h, ev.Headers)
	tok, enc := s.tok, s.enc
	if prev, ok := h[position.HeaderName]; ok {
		// A producer that also read or wrote other databases may have
		// stamped the event already; keep those entries. A malformed
		// header is dropped: our entry is still correct for this database.
		if pt, err := position.Decode(prev); err == nil {
			tok = pt.Merge(tok)
			enc, _ = tok.Encode()
		}
	}
	if enc != "" {
		h[position.HeaderName] = enc
	} else {
		delete(h, position.HeaderName)
	}
	if ev.ID != "" {
		h[HeaderEventID] = ev.ID
	}
	ev.Headers = h
	ev.Token = tok
	return ev
}

// stamp stamps a single event.
func stamp(ev Event, tok position.Token) Event { return newStamper(tok).stamp(ev) }

// TokenFromHeaders returns the token a relay of this package stamped on a
// message: an ordinary caughtup token in position.HeaderName, compared
// like any other (position.Entry.Compare, or the consume package's
// router). A missing header returns the zero Token and no error, which
// consumers treat as unknown (read the primary).
func TokenFromHeaders(h map[string]string) (position.Token, error) {
	s, ok := h[position.HeaderName]
	if !ok || s == "" {
		return position.Token{}, nil
	}
	return position.Decode(s)
}

// TokenFromKafkaHeaders is TokenFromHeaders for a kafka-go message.
func TokenFromKafkaHeaders(h []kafka.Header) (position.Token, error) {
	for _, x := range h {
		if x.Key == position.HeaderName && len(x.Value) > 0 {
			return position.Decode(string(x.Value))
		}
	}
	return position.Token{}, nil
}

// KafkaPublisher publishes events with a kafka-go Writer: topic = Event.Topic
// (unless the writer has a fixed Topic), key = Event.Key, value =
// Event.Payload, and every header including the token and event ID.
type KafkaPublisher struct {
	w *kafka.Writer
}

var _ Publisher = (*KafkaPublisher)(nil)

// ErrUnsafeWriter is returned by NewKafkaPublisher for a writer that does
// not wait for the broker's acknowledgement, so a relay would mark events
// done that may never have been stored.
var ErrUnsafeWriter = errors.New("caughtup/outbox: kafka.Writer must be synchronous (Async false) with RequiredAcks RequireOne or RequireAll")

// NewKafkaPublisher wraps w. It refuses an Async writer and RequiredAcks
// RequireNone (kafka-go's default): both return before the broker has the
// messages. Use a hash balancer (kafka.Hash) to keep per-key order.
func NewKafkaPublisher(w *kafka.Writer) (*KafkaPublisher, error) {
	if w == nil {
		return nil, errors.New("caughtup/outbox: NewKafkaPublisher: nil writer")
	}
	if w.Async || w.RequiredAcks == kafka.RequireNone {
		return nil, ErrUnsafeWriter
	}
	return &KafkaPublisher{w: w}, nil
}

// Publish writes the batch in one WriteMessages call and returns its error;
// on a partial failure the relay republishes the whole batch.
func (p *KafkaPublisher) Publish(ctx context.Context, events []Event) error {
	if len(events) == 0 {
		return nil
	}
	msgs := make([]kafka.Message, len(events))
	for i, ev := range events {
		m := kafka.Message{Key: ev.Key, Value: ev.Payload, Headers: kafkaHeaders(ev.Headers)}
		if p.w.Topic == "" {
			m.Topic = ev.Topic
		}
		msgs[i] = m
	}
	if err := p.w.WriteMessages(ctx, msgs...); err != nil {
		return fmt.Errorf("caughtup/outbox: kafka publish of %d events: %w", len(events), err)
	}
	return nil
}

// kafkaHeaders sorts by key so that identical events produce identical
// messages (maps iterate in random order).
func kafkaHeaders(h map[string]string) []kafka.Header {
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

// AsynqPublisher enqueues events as asynq tasks: type = Event.Topic,
// payload = Event.Payload, headers including the token, and TaskID =
// Event.ID so that a batch published twice enqueues each task once.
type AsynqPublisher struct {
	c    *asynq.Client
	opts []asynq.Option
}

var _ Publisher = (*AsynqPublisher)(nil)

// NewAsynqPublisher wraps c; opts (queue, retention, …) apply to every
// task. asynq rejects a reused TaskID only while the task is still in
// Redis: add asynq.Retention so that completed tasks keep deduplicating
// republished events for as long as a relay might resend them.
func NewAsynqPublisher(c *asynq.Client, opts ...asynq.Option) (*AsynqPublisher, error) {
	if c == nil {
		return nil, errors.New("caughtup/outbox: NewAsynqPublisher: nil client")
	}
	return &AsynqPublisher{c: c, opts: opts}, nil
}

// Publish enqueues the events one by one (asynq has no batch enqueue). An
// ErrTaskIDConflict means an earlier attempt already enqueued the event and
// counts as success.
func (p *AsynqPublisher) Publish(ctx context.Context, events []Event) error {
	for _, ev := range events {
		opts := p.opts
		if ev.ID != "" {
			opts = append(slices.Clip(p.opts), asynq.TaskID(ev.ID))
		}
		task := asynq.NewTaskWithHeaders(ev.Topic, ev.Payload, ev.Headers, opts...)
		if _, err := p.c.EnqueueContext(ctx, task); err != nil && !errors.Is(err, asynq.ErrTaskIDConflict) {
			return fmt.Errorf("caughtup/outbox: asynq enqueue of event %s (%s): %w", ev.ID, ev.Topic, err)
		}
	}
	return nil
}
