package caughtupkafka

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/internal/retry"
	engine "github.com/caughtup/caughtup/kafka"
)

// client is kafka-go as the engine uses it. A message is a pointer: a
// kafka-go Message is 150 bytes and the engine's path to the handler is
// several calls long; the handler gets its own copy. A message carries its
// trace context in its headers only, so client is no
// engine.SpanContexter.
type client struct{ c *Consumer }

var _ engine.Client[*kafka.Message, kafka.Header] = client{}

func (client) Place(m *kafka.Message) engine.Place {
	return engine.Place{Topic: m.Topic, Partition: int32(m.Partition), Offset: m.Offset, LeaderEpoch: -1}
}

func (client) Headers(m *kafka.Message) *[]kafka.Header { return &m.Headers }

// errNotRunning is Produce's error outside Run.
var errNotRunning = errors.New("caughtup/kafka: the consumer is not running")

// Produce writes to a retry or dead-letter topic through the Run's
// writer (ConsumerConfig.Writer or the default one).
func (cl client) Produce(ctx context.Context, topic string, m *kafka.Message, hs []kafka.Header) error {
	w := cl.c.w
	if w == nil {
		return errNotRunning
	}
	return w.WriteMessages(ctx, kafka.Message{Topic: topic, Key: m.Key, Value: m.Value, Headers: hs})
}

// reader is one assigned partition's kafka-go Reader, for one
// generation: the engine.Source of its worker. Not reading it is what
// holds a message in place: Pause and Resume do nothing.
type reader struct {
	c     *Consumer
	topic string
	id    int
	start int64
	r     *kafka.Reader
	// msg is the message at hand, reused: Next returns a pointer to it.
	msg kafka.Message
}

var _ engine.Source[*kafka.Message] = (*reader)(nil)

// open creates the Reader at the assignment's offset; false (after
// logging, and waiting for ctx to end) if it cannot seek.
func (r *reader) open(ctx context.Context) bool {
	cfg := &r.c.cfg
	r.r = kafka.NewReader(kafka.ReaderConfig{
		Brokers:         cfg.Brokers,
		Topic:           r.topic,
		Partition:       r.id,
		Dialer:          cfg.Dialer,
		QueueCapacity:   cfg.QueueCapacity,
		MinBytes:        cfg.MinBytes,
		MaxBytes:        cfg.MaxBytes,
		MaxWait:         cfg.MaxWait,
		ReadLagInterval: -1,
		ErrorLogger:     r.c.kafkaLogger(slog.LevelDebug),
	})
	if err := r.r.SetOffset(r.start); err != nil {
		r.c.log.ErrorContext(ctx, "caughtup/kafka: seeking a partition failed", slog.String("topic", r.topic),
			slog.Int("partition", r.id), slog.Any("error", err))
		_ = r.r.Close()
		<-ctx.Done()
		return false
	}
	return true
}

// Next fetches the partition's next message, retrying fetch errors with
// a backoff until ctx ends.
func (r *reader) Next(ctx context.Context) (*kafka.Message, bool) {
	for fails := 0; ; {
		msg, err := r.r.FetchMessage(ctx)
		if err == nil {
			r.msg = msg
			return &r.msg, true
		}
		if ctx.Err() != nil {
			return nil, false
		}
		fails++
		r.c.log.WarnContext(ctx, "caughtup/kafka: fetching failed; retrying", slog.String("topic", r.topic),
			slog.Int("partition", r.id), slog.Any("error", err))
		if !retry.Sleep(ctx, retry.Nth(fails, 100*time.Millisecond, 5*time.Second)) {
			return nil, false
		}
	}
}

func (*reader) Pause()  {}
func (*reader) Resume() {}
