package caughtupkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/retry"
	"github.com/caughtup/caughtup/internal/tracing"
	engine "github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// minDeferDelay keeps a deferral that asks for no delay from spinning.
const minDeferDelay = 10 * time.Millisecond

// process runs one message to its end: handled, republished to the retry
// topic, or dead-lettered. It returns false if ctx ended first; the
// message must then stay uncommitted, to be delivered again. msg is a
// pointer because a kafka-go Message is 150 bytes and the path to the
// handler is several calls long; the handler gets its own copy.
func (c *Consumer) process(ctx context.Context, msg *kafka.Message, w MessageWriter, ps *partState) bool {
	// The producer's trace continues here (unless ctx has a span of the
	// application's own): the routing spans and the handler's join it.
	ctx = tracing.Continue(ctx, c.prop, HeaderCarrier{&msg.Headers})
	// The token is read once per message; every attempt routes it again.
	mt := c.readToken(ctx, msg, ps)
	if mt.err != nil {
		mt.source = sourceOf(msg)
	}
	attempts := 0
	if c.cfg.Mode == RetryTopic && msg.Topic == c.cfg.RetryTopic {
		n, _ := engine.Int(msg.Headers, HeaderAttempts)
		attempts = int(max(0, min(n, int64(c.cfg.MaxAttempts))))
		if due, ok := engine.Int(msg.Headers, HeaderDue); ok {
			if !c.untilDue(ctx, msg, time.UnixMilli(due), mt.tok, mt.err, ps) {
				return false
			}
		}
	}
	for {
		hctx := ctx
		if attempts > 0 {
			hctx = context.WithValue(ctx, attemptKey{}, attempts)
		}
		err := c.attempt(hctx, msg, &mt, ps)
		if err == nil {
			ps.Add(engine.Handled)
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		var de *consume.DeferError
		if errors.As(err, &de) {
			delay := max(de.Delay, minDeferDelay)
			if c.cfg.Mode == RetryTopic {
				sctx, span := engine.StartDefer(ctx, c.tracer, de, engine.DeferRetryTopic, engine.RecordAttributes(msg.Topic, int32(msg.Partition), msg.Offset))
				ok := c.republish(sctx, w, *msg, time.Now().Add(delay), attempts, true)
				span.End()
				if !ok {
					return false
				}
				ps.Add(engine.Deferred)
				return true
			}
			// InPlace: keep the partition's order and wait here. Route
			// bounds this loop: once the token is older than the router's
			// MaxAge it sends the message to the primary. When Route has
			// just waited for a replica, that wait woke on the tracker's
			// observations; asking again at once keeps waking within
			// milliseconds of the catch-up rather than sleeping out a
			// deferral step that may be seconds long. Otherwise (the cap,
			// waiting disabled, no healthy replica, a tiny budget) hold
			// the delay, or less if a replica can serve the token first
			// (holdDeferred), so the loop never spins.
			ps.Add(engine.Waited)
			if de.Decision.Waited >= minDeferDelay {
				continue
			}
			sctx, span := engine.StartDefer(ctx, c.tracer, de, engine.DeferInPlace, engine.RecordAttributes(msg.Topic, int32(msg.Partition), msg.Offset))
			held, woken := false, false
			if mt.verify != nil {
				// The position alone does not say a Verifier will vouch
				// for the token: waking on it could route again at once,
				// again and again.
				held = retry.Sleep(sctx, delay)
			} else {
				held, woken = c.holdDeferred(sctx, time.Now().Add(delay), mt.tok, mt.err, ps)
			}
			engine.EndHold(span, woken)
			if !held {
				return false
			}
			continue
		}
		attempts++
		if attempts >= c.cfg.MaxAttempts {
			return c.deadLetter(ctx, w, *msg, attempts, err, ps)
		}
		delay := c.cfg.retryDelay(attempts)
		c.log.WarnContext(ctx, "caughtup/kafka: handler failed; retrying",
			slog.String("topic", msg.Topic), slog.Int("partition", msg.Partition), slog.Int64("offset", msg.Offset),
			slog.Int("attempt", attempts), slog.Duration("delay", delay), slog.Any("error", err))
		ps.Add(engine.Retried)
		if c.cfg.Mode == RetryTopic {
			return c.republish(ctx, w, *msg, time.Now().Add(delay), attempts, false)
		}
		if !retry.Sleep(ctx, delay) {
			return false
		}
	}
}

type attemptKey struct{}

// Attempt returns how many times the handler already failed on the message
// being handled in ctx: 0 on the first attempt. Deferrals (waiting for a
// replica) never count. In RetryTopic mode the count travels with the
// message in HeaderAttempts.
func Attempt(ctx context.Context) int {
	n, _ := ctx.Value(attemptKey{}).(int)
	return n
}

// attempt routes msg, whose token readToken read as mt, through the
// partition's Tally, and runs the handler with the routed context. It returns Route's *consume.DeferError
// when no replica can serve the message yet.
func (c *Consumer) attempt(ctx context.Context, msg *kafka.Message, mt *msgToken, ps *partState) error {
	rctx, _, err := ps.Tally.Route(ctx, consume.Job{
		Token: mt.tok, TokenErr: mt.err, Policy: c.cfg.Policy, Source: mt.source, Verify: mt.verify,
	})
	if err != nil {
		return err
	}
	return c.call(rctx, msg)
}

// call runs the handler, turning a panic into an error so that one bad
// message is retried and dead-lettered instead of killing the process.
func (c *Consumer) call(ctx context.Context, msg *kafka.Message) (err error) {
	defer func() {
		if r := recover(); r != nil {
			c.log.ErrorContext(ctx, "caughtup/kafka: handler panicked", slog.Any("panic", r),
				slog.String("stack", string(debug.Stack())))
			err = fmt.Errorf("caughtup/kafka: handler panicked: %v", r)
		}
	}()
	return c.handler(ctx, *msg)
}

// untilDue holds a retry-topic message until its due time, or, for a
// message deferred for lag (HeaderDeferred), until a replica has replayed
// its token if that comes first: the deferral's delay only stood in for
// "until a replica catches up". A message retried after a handler error
// waits out its backoff whatever the replicas do. It returns false if ctx
// ended first.
//
// Retry partitions are roughly in due order (each message is appended at
// now+delay), so waiting here for the head costs the messages behind it
// little; a message behind the head waits for it even when its own token
// is caught up.
func (c *Consumer) untilDue(ctx context.Context, msg *kafka.Message, due time.Time, tok position.Token, tokErr error, ps *partState) bool {
	if !engine.Has(msg.Headers, HeaderDeferred) {
		return retry.Sleep(ctx, time.Until(due))
	}
	// Past its due time the message is routed once and, if still behind,
	// deferred again with a new due time: no loop, so even a token that a
	// Verifier vouches for may wake on its position.
	ctx, span := engine.StartWake(ctx, c.tracer, engine.RecordAttributes(msg.Topic, int32(msg.Partition), msg.Offset))
	held, woken := c.holdDeferred(ctx, due, tok, tokErr, ps)
	engine.EndHold(span, woken)
	return held
}

// holdDeferred holds a message deferred for lag until deadline, or until
// a replica has replayed tok (consume.Router.WaitCaughtUp: exactly the
// replicas routing would choose) if that comes first, which counts as
// engine.Woken. A message without a readable token sleeps until deadline:
// its catch-up cannot be waited for. It returns false if ctx ended first,
// and whether the catch-up ended the hold.
func (c *Consumer) holdDeferred(ctx context.Context, deadline time.Time, tok position.Token, tokErr error, ps *partState) (held, woken bool) {
	if tokErr != nil || tok.IsZero() {
		return retry.Sleep(ctx, time.Until(deadline)), false
	}
	if !time.Now().Before(deadline) {
		return ctx.Err() == nil, false
	}
	dctx, cancel := context.WithDeadline(ctx, deadline)
	err := c.cfg.Router.WaitCaughtUp(dctx, tok)
	cancel()
	switch {
	case ctx.Err() != nil:
		return false, false
	case err == nil:
		ps.Add(engine.Woken)
		return true, true
	}
	return true, false
}

// republish writes msg to the retry topic, due at due, and waits for the
// broker's acknowledgement. The original is committed only afterwards, so
// a crash in between delivers the original again and the retry topic gets
// a duplicate: nothing is lost. deferred marks a deferral for lag
// (HeaderDeferred), which runs as soon as a replica catches up.
func (c *Consumer) republish(ctx context.Context, w MessageWriter, msg kafka.Message, due time.Time, attempts int, deferred bool) bool {
	out := kafka.Message{Topic: c.cfg.RetryTopic, Key: msg.Key, Value: msg.Value,
		Headers: engine.RetryHeaders(msg.Headers, msg.Topic, int32(msg.Partition), msg.Offset, attempts, due.UnixMilli(), deferred)}
	return c.publish(ctx, w, out)
}

// deadLetter hands a message that failed attempts times to the hook or the
// dead-letter topic, retrying until that succeeds or ctx ends: a message
// is never committed unless it was handled or parked somewhere.
func (c *Consumer) deadLetter(ctx context.Context, w MessageWriter, msg kafka.Message, attempts int, cause error, ps *partState) bool {
	c.log.ErrorContext(ctx, "caughtup/kafka: handler failed on every attempt; dead-lettering the message",
		slog.String("topic", msg.Topic), slog.Int("partition", msg.Partition), slog.Int64("offset", msg.Offset),
		slog.Int("attempts", attempts), slog.Any("error", cause))
	ok := false
	if c.cfg.DeadLetter != nil {
		for n := 1; ; n++ {
			err := c.cfg.DeadLetter(ctx, msg, cause)
			if err == nil {
				ok = true
				break
			}
			if ctx.Err() != nil {
				break
			}
			c.log.WarnContext(ctx, "caughtup/kafka: the dead-letter hook failed; calling it again", slog.Any("error", err))
			if !retry.Sleep(ctx, retry.Nth(n, 100*time.Millisecond, 10*time.Second)) {
				break
			}
		}
	} else {
		out := kafka.Message{Topic: c.cfg.DeadLetterTopic, Key: msg.Key, Value: msg.Value,
			Headers: engine.DeadLetterHeaders(msg.Headers, msg.Topic, int32(msg.Partition), msg.Offset, attempts, cause)}
		ok = c.publish(ctx, w, out)
	}
	if ok {
		ps.Add(engine.DeadLettered)
	}
	return ok
}

// publish writes m until the broker acknowledges it or ctx ends.
func (c *Consumer) publish(ctx context.Context, w MessageWriter, m kafka.Message) bool {
	for n := 1; ; n++ {
		err := w.WriteMessages(ctx, m)
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		c.log.WarnContext(ctx, "caughtup/kafka: writing to a retry or dead-letter topic failed; retrying",
			slog.String("topic", m.Topic), slog.Any("error", err))
		if !retry.Sleep(ctx, retry.Nth(n, 100*time.Millisecond, 10*time.Second)) {
			return false
		}
	}
}
