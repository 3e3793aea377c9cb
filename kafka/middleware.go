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
// before next runs: it reads the token header (TokenHeader) and calls
// router.Route, which may wait in process for a replica to catch up
// (consume.Config.WaitBudget). next then runs with a context whose pools
// consume.DB returns and whose token children inherit.
//
// When no replica can serve the message yet the decorator returns Route's
// *consume.DeferError without calling next. The Consumer turns that into
// a wait in place or a republish, by its Mode; code with its own consume
// loop must do one of the two and must not commit the message.
func Middleware(router *consume.Router, policy consume.Policy) func(Handler) Handler {
	return func(next Handler) Handler {
		return func(ctx context.Context, msg kafkago.Message) error {
			rctx, _, err := router.Route(ctx, TokenHeader(msg), policy)
			if err != nil {
				return err
			}
			return next(rctx, msg)
		}
	}
}
