package kafka

import (
	"context"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
)

// Handler processes one message. ctx is cancelled when the consumer stops
// or the partition is revoked in a rebalance; the message is then
// delivered again, here or to another member, so a handler must be
// idempotent (at-least-once) and should return promptly once ctx ends.
type Handler func(ctx context.Context, msg kafkago.Message) error

// Middleware returns a decorator that routes each message with router
// before next runs: it reads the token with TokenOf and calls
// router.RouteDecoded, which may wait in process for a replica to catch up
// (consume.Config.WaitBudget). next then runs with a context whose pools
// consume.DB returns and whose token children inherit. A message whose
// token headers do not decode reads the primary; the router's warning
// names the topic.
//
// When no replica can serve the message yet the decorator returns Route's
// *consume.DeferError without calling next. The Consumer turns that into
// a wait in place or a republish, by its Mode; code with its own consume
// loop must do one of the two and must not commit the message.
func Middleware(router *consume.Router, policy consume.Policy) func(Handler) Handler {
	return func(next Handler) Handler {
		return func(ctx context.Context, msg kafkago.Message) error {
			tok, err := TokenOf(msg)
			if err != nil {
				ctx = withSource(ctx, msg)
			}
			rctx, _, err := router.RouteDecoded(ctx, tok, err, policy)
			if err != nil {
				return err
			}
			return next(rctx, msg)
		}
	}
}

// withSource names the message's topic in the router's warnings about its
// token. Called only when there is something to warn about: it allocates.
func withSource(ctx context.Context, msg kafkago.Message) context.Context {
	return consume.WithSource(ctx, "kafka "+msg.Topic)
}
