package kafka

import (
	"context"
	"fmt"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// MessageWriter is what the stamping Writer wraps and what the Consumer
// republishes through: *kafkago.Writer, or anything with its WriteMessages.
type MessageWriter interface {
	WriteMessages(ctx context.Context, msgs ...kafkago.Message) error
}

var (
	_ MessageWriter = (*kafkago.Writer)(nil)
	_ MessageWriter = (*Writer)(nil)
)

// Writer stamps every message it writes with the token of the context it
// is written with (enqueue.TokenFrom), in the header position.HeaderName,
// then hands the messages to the wrapped writer.
//
// Producer settings matter for what consumers can promise. Give the
// kafkago.Writer a key-hashing Balancer (&kafkago.Hash{}, or
// kafkago.Murmur2Balancer{} to match Java producers): the default
// round-robin balancer spreads one key over every partition and no
// consumer can keep its order. Set RequiredAcks to kafkago.RequireAll:
// the default, RequireNone, can lose an acknowledged message when a
// leader fails. Lower BatchTimeout (default 1s) for synchronous writes:
// each WriteMessages call waits for its batch to fill or time out.
type Writer struct {
	w MessageWriter
}

// NewWriter returns a Writer that stamps messages and writes them to w.
// It does not take ownership of w: close a *kafkago.Writer yourself.
func NewWriter(w MessageWriter) *Writer { return &Writer{w: w} }

// Unwrap returns the wrapped writer.
func (w *Writer) Unwrap() MessageWriter { return w.w }

// WriteMessages stamps msgs (see Stamp) and writes them. The caller's
// messages and header slices are not modified.
func (w *Writer) WriteMessages(ctx context.Context, msgs ...kafkago.Message) error {
	stamped, err := Stamped(ctx, msgs)
	if err != nil {
		return err
	}
	return w.w.WriteMessages(ctx, stamped...)
}

// Stamped returns copies of msgs carrying the token of ctx (see Stamp);
// msgs and their header slices are not modified. Without a token in ctx it
// returns msgs itself.
func Stamped(ctx context.Context, msgs []kafkago.Message) ([]kafkago.Message, error) {
	tok, ok := enqueue.TokenFrom(ctx)
	if !ok {
		return msgs, nil
	}
	enc, err := tok.Encode()
	if err != nil {
		return nil, fmt.Errorf("caughtup/kafka: encoding the context's token: %w", err)
	}
	out := make([]kafkago.Message, len(msgs))
	for i := range msgs {
		out[i] = msgs[i]
		out[i].Headers = stampHeaders(msgs[i].Headers, tok, enc)
	}
	return out, nil
}

// Stamp adds the token of ctx to msg's headers in place, for code that
// builds messages for its own writer. A token header msg already carries
// is merged with it (position.Token.Merge: the message then waits for
// both), and duplicate token headers are folded into one. An existing
// header that does not decode is kept as it is and the context's token is
// not added: consumers read such a message from the primary, which
// satisfies both. Without a token in ctx msg is unchanged.
//
// Stamp replaces msg.Headers with a new slice, so a header slice shared
// with other messages is not modified.
func Stamp(ctx context.Context, msg *kafkago.Message) error {
	tok, ok := enqueue.TokenFrom(ctx)
	if !ok {
		return nil
	}
	enc, err := tok.Encode()
	if err != nil {
		return fmt.Errorf("caughtup/kafka: encoding the context's token: %w", err)
	}
	msg.Headers = stampHeaders(msg.Headers, tok, enc)
	return nil
}

// stampHeaders returns a new header slice: hs without token headers, plus
// one token header that is tok (encoded as enc) merged with the tokens hs
// carried.
func stampHeaders(hs []kafkago.Header, tok position.Token, enc string) []kafkago.Header {
	out := make([]kafkago.Header, 0, len(hs)+1)
	merged := tok
	changed := false
	for _, h := range hs {
		if h.Key != position.HeaderName {
			out = append(out, h)
			continue
		}
		if len(h.Value) == 0 {
			continue
		}
		prev, err := position.Decode(string(h.Value))
		if err != nil {
			// Unreadable (malformed, or from a newer producer): keep it, so
			// the consumer reads the primary rather than trusting the
			// context's token alone.
			return append(slicesWithout(hs), h)
		}
		merged = merged.Merge(prev)
		changed = true
	}
	if changed {
		if e, err := merged.Encode(); err == nil {
			enc = e
		} else {
			// The merge is too large to carry (more databases than a token
			// holds): send none, so the consumer reads the primary.
			return out
		}
	}
	return append(out, kafkago.Header{Key: position.HeaderName, Value: []byte(enc)})
}

// slicesWithout returns a copy of hs without its token headers.
func slicesWithout(hs []kafkago.Header) []kafkago.Header {
	out := make([]kafkago.Header, 0, len(hs)+1)
	for _, h := range hs {
		if h.Key != position.HeaderName {
			out = append(out, h)
		}
	}
	return out
}

// TokenHeader returns the token text msg carries ("" for none), as
// consume.Router.Route takes it. Several token headers are merged into one;
// if any of them does not decode, that one is returned, so Route reads the
// primary (ReasonMalformedToken).
func TokenHeader(msg kafkago.Message) string {
	var first []byte
	n := 0
	for _, h := range msg.Headers {
		if h.Key == position.HeaderName && len(h.Value) > 0 {
			if n == 0 {
				first = h.Value
			}
			n++
		}
	}
	switch n {
	case 0:
		return ""
	case 1:
		return string(first)
	}
	var merged position.Token
	for _, h := range msg.Headers {
		if h.Key != position.HeaderName || len(h.Value) == 0 {
			continue
		}
		tok, err := position.Decode(string(h.Value))
		if err != nil {
			return string(h.Value)
		}
		merged = merged.Merge(tok)
	}
	enc, err := merged.Encode()
	if err != nil {
		// Too many databases for one token. Tokens never contain a comma,
		// so the joined text is malformed and Route reads the primary,
		// the only safe answer.
		return string(first) + "," + enc
	}
	return enc
}
