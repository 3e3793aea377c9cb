package kafka

import (
	"context"
	"sync/atomic"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
)

// partState is what one partition's worker keeps from message to message,
// for one generation. At hundreds of thousands of messages a second, what
// a message costs besides its handler is mostly bookkeeping, so the worker
// does it in bulk:
//
//   - its results and the router's decisions are counted here and added
//     to the instruments (caughtup.kafka.messages, consume's
//     caughtup.consume.decisions and the rest) by flush, which the
//     committer calls at every commit (CommitInterval) and once the
//     worker has stopped, before Run returns: an OpenTelemetry SDK Add
//     costs a few hundred nanoseconds, a message would pay three;
//   - the last token header it decoded is kept with its token: messages
//     written together (a batch of one transaction's events, an outbox
//     relay's batch stamped with one position) carry the same header, and
//     decoding one costs half a microsecond and two allocations.
type partState struct {
	tm      *topicMetrics
	results [numResults]atomic.Int64
	tally   *consume.Tally

	// The worker's alone: the last single token header decoded, and
	// what it decoded to.
	header string
	tok    position.Token
	tokErr error
}

func (c *Consumer) newPartState(topic string) *partState {
	return &partState{tm: c.met.topic(topic), tally: c.cfg.Router.NewTally()}
}

// add counts one message's result until the next flush.
func (ps *partState) add(_ context.Context, r Result) { ps.results[r].Add(1) }

// flush adds the counts since the last flush to the instruments.
func (ps *partState) flush(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	for r := range numResults {
		if n := ps.results[r].Swap(0); n > 0 {
			ps.tm.messages.Add(ctx, n, ps.tm.opts[r])
		}
	}
	ps.tally.Flush(ctx)
}

// tokenOf is TokenOf, remembering the last single token header: a message
// whose one token header is the same text gets the same token (Tokens are
// values, never modified).
func (ps *partState) tokenOf(msg kafkago.Message) (position.Token, error) {
	var one []byte
	n := 0
	for _, h := range msg.Headers {
		if h.Key == position.HeaderName && len(h.Value) > 0 {
			one = h.Value
			n++
		}
	}
	switch {
	case n == 0:
		return position.Token{}, nil
	case n > 1:
		return TokenOf(msg)
	case ps.header != "" && string(one) == ps.header:
		return ps.tok, ps.tokErr
	}
	// TokenOf, keeping the text it decodes.
	h := string(one)
	tok, err := position.DecodeHeaders(h)
	ps.header, ps.tok, ps.tokErr = h, tok, err
	return tok, err
}
