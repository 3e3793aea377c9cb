package caughtupkafka

import (
	engine "github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// partState is what one partition's worker keeps from message to message,
// for one generation. At hundreds of thousands of messages a second, what
// a message costs besides its handler is mostly bookkeeping, so the worker
// does it in bulk or reuses it:
//
//   - its results and the router's decisions are counted here and added
//     to the instruments (caughtup.kafka.messages, consume's
//     caughtup.consume.decisions and the rest) by flush, which the
//     committer calls at every commit (CommitInterval) and once the
//     worker has stopped, before Run returns: an OpenTelemetry SDK Add
//     costs a few hundred nanoseconds, a message would pay three;
//   - tokens are decoded by a position.HeaderDecoder, which allocates
//     nothing per message and decodes a run of messages with the same
//     header (a batch of one transaction's events, an outbox relay's
//     batch stamped with one position) once.
type partState struct {
	engine.Counts

	// The worker's alone. The token it returns is valid until the next
	// message's: the Router keeps nothing of the tokens it routes.
	dec position.HeaderDecoder
}

func (c *Consumer) newPartState(topic string) *partState {
	return &partState{Counts: engine.Counts{Topic: c.met[topic], Tally: c.cfg.Router.NewTally()}}
}
