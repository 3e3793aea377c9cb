package caughtupkafka

import (
	"context"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
)

// Handler processes one message. The Consumer calls it with a context
// routed by its Router: consume.DB and consume.SQLDB return the pool
// chosen for the message, and jobs the handler enqueues inherit the
// message's token. ctx is cancelled when the consumer stops or the
// partition is revoked in a rebalance; the message is then delivered
// again, here or to another member, so a handler must be idempotent
// (at-least-once) and should return promptly once ctx ends.
//
// A handler may return a *consume.DeferError of its own (from routing a
// second token, say): the Consumer treats it as it treats its own
// deferrals (Mode).
type Handler func(ctx context.Context, msg kafka.Message) error

// engine is h as the engine calls it, with a pointer to the message (nil
// for a nil h, which the engine refuses).
func (h Handler) engine() func(context.Context, *kafka.Message) error {
	if h == nil {
		return nil
	}
	return func(ctx context.Context, msg *kafka.Message) error { return h(ctx, *msg) }
}

// Middleware returns a decorator that routes each message with router
// before next runs, for code with its own consume loop (the Consumer
// routes by itself, with ConsumerConfig.Router). It reads the token with
// TokenOf and calls router.Route, which may wait in process for a
// replica to catch up (consume.Config.WaitBudget). next then runs with a
// context whose pools consume.DB returns and whose token children inherit.
// A message whose token headers do not decode reads the primary; the
// router's warning names the topic.
//
// When no replica can serve the message yet the decorator returns
// Route's *consume.DeferError without calling next. The caller's
// loop must then wait and call again, or republish the message, and must
// not commit it before one of the two is done.
func Middleware(router *consume.Router, policy consume.Policy) func(Handler) Handler {
	return func(next Handler) Handler {
		return func(ctx context.Context, msg kafka.Message) error {
			tok, err := TokenOf(msg)
			job := consume.Job{Token: tok, TokenErr: err, Policy: policy}
			if err != nil {
				job.Source = sourceOf(&msg)
			}
			rctx, _, err := router.Route(ctx, job)
			if err != nil {
				return err
			}
			return next(rctx, msg)
		}
	}
}

// sourceOf names the message's topic in the router's warnings about its
// token (consume.Job.Source). Called only when there is something to warn
// about: it allocates.
func sourceOf(msg *kafka.Message) string { return "kafka " + msg.Topic }
