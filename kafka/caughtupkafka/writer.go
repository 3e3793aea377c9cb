package caughtupkafka

import (
	"context"
	"fmt"
	"slices"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/enqueue"
	engine "github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// MessageWriter is what the stamping Writer wraps and what the Consumer
// republishes through: *kafka.Writer, or anything with its WriteMessages.
type MessageWriter interface {
	WriteMessages(ctx context.Context, msgs ...kafka.Message) error
}

var (
	_ MessageWriter = (*kafka.Writer)(nil)
	_ MessageWriter = (*Writer)(nil)
)

// Writer stamps every message it writes with the token of the context it
// is written with (enqueue.TokenFrom), in the header position.HeaderName,
// then hands the messages to the wrapped writer.
//
// Producer settings matter for what consumers can promise. Give the
// kafka.Writer a key-hashing Balancer (&kafka.Hash{}, or
// kafka.Murmur2Balancer{} to match Java producers): the default
// round-robin balancer spreads one key over every partition and no
// consumer can keep its order. Set RequiredAcks to kafka.RequireAll:
// the default, RequireNone, can lose an acknowledged message when a
// leader fails. Lower BatchTimeout (default 1s) for synchronous writes:
// each WriteMessages call waits for its batch to fill or time out.
type Writer struct {
	w MessageWriter
}

// NewWriter returns a Writer that stamps messages and writes them to w.
// It does not take ownership of w: close a *kafka.Writer yourself.
func NewWriter(w MessageWriter) *Writer { return &Writer{w: w} }

// Unwrap returns the wrapped writer.
func (w *Writer) Unwrap() MessageWriter { return w.w }

// WriteMessages stamps msgs (see Stamp) and writes them. The caller's
// messages and header slices are not modified. If a message cannot be
// stamped, nothing is written.
func (w *Writer) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	stamped, err := Stamped(ctx, msgs)
	if err != nil {
		return err
	}
	return w.w.WriteMessages(ctx, stamped...)
}

// Stamped returns copies of msgs carrying the token of ctx (see Stamp);
// msgs and their header slices are not modified. Without a token or a
// trace context (see Stamp) in ctx it returns msgs itself. The error names the first message that cannot be
// stamped; then no message is returned.
func Stamped(ctx context.Context, msgs []kafka.Message) ([]kafka.Message, error) {
	tok, ok := enqueue.TokenFrom(ctx)
	stamp := ok && !tok.IsZero()
	tf := producerTrace(ctx)
	if !stamp && len(tf) == 0 {
		return msgs, nil
	}
	// Most messages carry no token header yet: encode the context's token
	// once for all of them.
	var alone string
	if stamp {
		var err error
		if alone, err = position.MergeHeader("", tok); err != nil {
			return nil, fmt.Errorf("caughtup/kafka: encoding the context's token: %w", err)
		}
	}
	out := make([]kafka.Message, len(msgs))
	for i := range msgs {
		out[i] = msgs[i]
		hs := msgs[i].Headers
		if stamp {
			var err error
			if hs, err = engine.Stamped(hs, tok, alone); err != nil {
				return nil, fmt.Errorf("caughtup/kafka: stamping message %d: %w", i, err)
			}
		}
		if th := engine.MissingHeaders(hs, tf); len(th) > 0 {
			hs = append(slices.Clip(hs), th...)
		}
		out[i].Headers = hs
	}
	return out, nil
}

// Stamp adds the token of ctx to msg's headers in place, for code that
// builds messages for its own writer. The rule is position.MergeHeader's:
//
//   - msg carries no token header: the context's token is added.
//   - msg carries token headers that decode: they and the context's token
//     are merged into one header (the message then waits for all of them).
//   - one of them does not decode (malformed, or from a newer producer):
//     that header is kept as msg's only token header and the context's
//     token is not added. Consumers read such a message from the primary,
//     which satisfies every token; unknown stays unknown.
//
// An error means the merged token cannot be carried (more than
// position.MaxDatabases databases, an invalid database name); msg is then
// unchanged. Without either in ctx msg is unchanged.
//
// Stamp replaces msg.Headers with a new slice, so a header slice shared
// with other messages is not modified.
//
// Stamp and Writer also write ctx's trace context into headers msg does
// not have yet, through the global propagators (otel.SetTextMapPropagator;
// the default propagates nothing), so that the consumer's spans continue
// the producer's trace (ConsumerConfig.Propagators).
func Stamp(ctx context.Context, msg *kafka.Message) error {
	tok, ok := enqueue.TokenFrom(ctx)
	if ok {
		if err := stampToken(msg, tok); err != nil {
			return err
		}
	}
	if th := engine.MissingHeaders(msg.Headers, producerTrace(ctx)); len(th) > 0 {
		msg.Headers = append(slices.Clip(msg.Headers), th...)
	}
	return nil
}

// stampToken is Stamp with the token given rather than taken from a
// context (a relay stamps the position of the events it read).
func stampToken(msg *kafka.Message, tok position.Token) error {
	if tok.IsZero() {
		return nil
	}
	hs, err := engine.Stamped(msg.Headers, tok, "")
	if err != nil {
		return fmt.Errorf("caughtup/kafka: stamping a message: %w", err)
	}
	msg.Headers = hs
	return nil
}

// TokenOf returns the token msg carries, read with position.DecodeHeaders
// from every position.HeaderName header: the zero Token and nil when it
// carries none, the tokens of several headers merged, and the zero Token
// with a *position.DecodeError when any of them does not decode. Give both
// to consume.Router.Route (as Job.Token and Job.TokenErr), which sends a message whose token does
// not decode to the primary (ReasonMalformedToken); Middleware and the
// Consumer do.
func TokenOf(msg kafka.Message) (position.Token, error) { return engine.TokenOf(msg.Headers) }
