package caughtupkgo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/retry"
	"github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// minDeferDelay keeps a deferral that asks for no delay from spinning.
const minDeferDelay = 10 * time.Millisecond

// recordToken is a record's token as read once: every attempt routes it
// again.
type recordToken struct {
	tok    position.Token
	err    error
	source string
}

// process runs one record to its end: handled, produced to the retry
// topic, or dead-lettered. It returns false if ctx ended first; the
// record must then stay uncommitted, to be delivered again.
func (c *Consumer) process(ctx context.Context, r *kgo.Record, p *partition) bool {
	defer p.release()
	// The producer's trace continues here (unless ctx has a span): the
	// routing spans and the handler's join it.
	ctx = c.traceContext(ctx, r)
	var rt recordToken
	rt.tok, rt.err = kafka.DecodeToken(&p.dec, r.Headers)
	if rt.err != nil {
		// Named only when the router has something to warn about: the
		// string allocates.
		rt.source = "kafka " + r.Topic
	}
	attempts := 0
	if c.cfg.Mode == RetryTopic && r.Topic == c.cfg.RetryTopic {
		n, _ := kafka.Int(r.Headers, HeaderAttempts)
		attempts = int(max(0, min(n, int64(c.cfg.MaxAttempts))))
		if due, ok := kafka.Int(r.Headers, HeaderDue); ok && time.Now().Before(time.UnixMilli(due)) {
			p.hold()
			if !c.untilDue(ctx, r, time.UnixMilli(due), &rt, p) {
				return false
			}
		}
	}
	for {
		hctx := ctx
		if attempts > 0 {
			hctx = context.WithValue(ctx, attemptKey{}, attempts)
		}
		err := c.attempt(hctx, r, &rt, p)
		if err == nil {
			p.counts.Add(kafka.Handled)
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		var de *consume.DeferError
		if errors.As(err, &de) {
			delay := max(de.Delay, minDeferDelay)
			if c.cfg.Mode == RetryTopic {
				sctx, span := kafka.StartDefer(ctx, c.tracer, de, kafka.DeferRetryTopic, kafka.RecordAttributes(r.Topic, r.Partition, r.Offset))
				ok := c.republish(sctx, r, time.Now().Add(delay), attempts, true)
				span.End()
				if !ok {
					return false
				}
				p.counts.Add(kafka.Deferred)
				return true
			}
			// InPlace: pause the partition and hold the record. Route
			// bounds this loop: once the token is older than the router's
			// MaxAge it sends the record to the primary. When Route has
			// just waited for a replica (woken by the tracker's
			// observations), ask again at once; otherwise (the cap,
			// waiting disabled, no healthy replica) hold the delay, or
			// less if a replica can serve the token first, so the loop
			// never spins.
			p.counts.Add(kafka.Waited)
			p.hold()
			if de.Decision.Waited >= minDeferDelay {
				continue
			}
			sctx, span := kafka.StartDefer(ctx, c.tracer, de, kafka.DeferInPlace, kafka.RecordAttributes(r.Topic, r.Partition, r.Offset))
			held, woken := c.holdDeferred(sctx, time.Now().Add(delay), &rt, p)
			kafka.EndHold(span, woken)
			if !held {
				return false
			}
			continue
		}
		attempts++
		if attempts >= c.cfg.MaxAttempts {
			return c.deadLetter(ctx, r, attempts, err, p)
		}
		delay := c.cfg.retryDelay(attempts)
		c.log.WarnContext(ctx, "caughtup/kgo: handler failed; retrying",
			slog.String("topic", r.Topic), slog.Int("partition", int(r.Partition)), slog.Int64("offset", r.Offset),
			slog.Int("attempt", attempts), slog.Duration("delay", delay), slog.Any("error", err))
		p.counts.Add(kafka.Retried)
		if c.cfg.Mode == RetryTopic {
			return c.republish(ctx, r, time.Now().Add(delay), attempts, false)
		}
		p.hold()
		if !retry.Sleep(ctx, delay) {
			return false
		}
	}
}

type attemptKey struct{}

// Attempt returns how many times the handler already failed on the record
// being handled in ctx: 0 on the first attempt. Deferrals (waiting for a
// replica) never count. In RetryTopic mode the count travels with the
// record in HeaderAttempts.
func Attempt(ctx context.Context) int {
	n, _ := ctx.Value(attemptKey{}).(int)
	return n
}

// attempt routes r through the partition's Tally and runs the handler
// with the routed context. It returns Route's *consume.DeferError when no
// replica can serve the record yet.
func (c *Consumer) attempt(ctx context.Context, r *kgo.Record, rt *recordToken, p *partition) error {
	rctx, _, err := p.counts.Tally.Route(ctx, consume.Job{
		Token: rt.tok, TokenErr: rt.err, Policy: c.cfg.Policy, Source: rt.source,
	})
	if err != nil {
		return err
	}
	return c.call(rctx, r)
}

// call runs the handler, turning a panic into an error so that one bad
// record is retried and dead-lettered instead of killing the process.
func (c *Consumer) call(ctx context.Context, r *kgo.Record) (err error) {
	defer func() {
		if v := recover(); v != nil {
			c.log.ErrorContext(ctx, "caughtup/kgo: handler panicked", slog.Any("panic", v),
				slog.String("stack", string(debug.Stack())))
			err = fmt.Errorf("caughtup/kgo: handler panicked: %v", v)
		}
	}()
	return c.handler(ctx, r)
}

// untilDue holds a retry-topic record until its due time, or, for a
// record deferred for lag (HeaderDeferred), until a replica has replayed
// its token if that comes first: the deferral's delay only stood in for
// "until a replica catches up". A record retried after a handler error
// waits out its backoff whatever the replicas do.
func (c *Consumer) untilDue(ctx context.Context, r *kgo.Record, due time.Time, rt *recordToken, p *partition) bool {
	if !kafka.Has(r.Headers, HeaderDeferred) {
		return retry.Sleep(ctx, time.Until(due))
	}
	ctx, span := kafka.StartWake(ctx, c.tracer, kafka.RecordAttributes(r.Topic, r.Partition, r.Offset))
	held, woken := c.holdDeferred(ctx, due, rt, p)
	kafka.EndHold(span, woken)
	return held
}

// holdDeferred holds a record deferred for lag until deadline, or until a
// replica has replayed its token (consume.Router.WaitCaughtUp: exactly the
// replicas routing would choose) if that comes first, which counts as
// woken. A record without a readable token sleeps until deadline: its
// catch-up cannot be waited for. It returns false if ctx ended first,
// and whether the catch-up ended the hold.
func (c *Consumer) holdDeferred(ctx context.Context, deadline time.Time, rt *recordToken, p *partition) (held, woken bool) {
	if rt.err != nil || rt.tok.IsZero() {
		return retry.Sleep(ctx, time.Until(deadline)), false
	}
	if !time.Now().Before(deadline) {
		return ctx.Err() == nil, false
	}
	dctx, cancel := context.WithDeadline(ctx, deadline)
	err := c.cfg.Router.WaitCaughtUp(dctx, rt.tok)
	cancel()
	switch {
	case ctx.Err() != nil:
		return false, false
	case err == nil:
		p.counts.Add(kafka.Woken)
		return true, true
	}
	return true, false
}

// republish produces r to the retry topic, due at due, and waits for the
// broker's acknowledgement. The original is marked done only afterwards,
// so a crash in between delivers the original again and the retry topic
// gets a duplicate: nothing is lost.
func (c *Consumer) republish(ctx context.Context, r *kgo.Record, due time.Time, attempts int, deferred bool) bool {
	return c.publish(ctx, &kgo.Record{Topic: c.cfg.RetryTopic, Key: r.Key, Value: r.Value,
		Headers: kafka.RetryHeaders(r.Headers, r.Topic, r.Partition, r.Offset, attempts, due.UnixMilli(), deferred)})
}

// deadLetter hands a record that failed attempts times to the hook or the
// dead-letter topic, retrying until that succeeds or ctx ends: a record is
// never committed unless it was handled or parked somewhere.
func (c *Consumer) deadLetter(ctx context.Context, r *kgo.Record, attempts int, cause error, p *partition) bool {
	c.log.ErrorContext(ctx, "caughtup/kgo: handler failed on every attempt; dead-lettering the record",
		slog.String("topic", r.Topic), slog.Int("partition", int(r.Partition)), slog.Int64("offset", r.Offset),
		slog.Int("attempts", attempts), slog.Any("error", cause))
	ok := false
	if c.cfg.DeadLetter != nil {
		for n := 1; ; n++ {
			err := c.cfg.DeadLetter(ctx, r, cause)
			if err == nil {
				ok = true
				break
			}
			if ctx.Err() != nil {
				break
			}
			c.log.WarnContext(ctx, "caughtup/kgo: the dead-letter hook failed; calling it again", slog.Any("error", err))
			if !retry.Sleep(ctx, retry.Nth(n, 100*time.Millisecond, 10*time.Second)) {
				break
			}
		}
	} else {
		ok = c.publish(ctx, &kgo.Record{Topic: c.cfg.DeadLetterTopic, Key: r.Key, Value: r.Value,
			Headers: kafka.DeadLetterHeaders(r.Headers, r.Topic, r.Partition, r.Offset, attempts, cause)})
	}
	if ok {
		p.counts.Add(kafka.DeadLettered)
	}
	return ok
}

// publish produces out with the consumer's client until the broker
// acknowledges it or ctx ends.
func (c *Consumer) publish(ctx context.Context, out *kgo.Record) bool {
	cl := c.client.Load()
	if cl == nil {
		return false
	}
	for n := 1; ; n++ {
		err := cl.ProduceSync(ctx, out).FirstErr()
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		c.log.WarnContext(ctx, "caughtup/kgo: producing to a retry or dead-letter topic failed; retrying",
			slog.String("topic", out.Topic), slog.Any("error", err))
		if !retry.Sleep(ctx, retry.Nth(n, 100*time.Millisecond, 10*time.Second)) {
			return false
		}
		// A failed record cannot be produced again as it is: franz-go
		// keeps its partition and producer state on it.
		out = &kgo.Record{Topic: out.Topic, Key: out.Key, Value: out.Value, Headers: out.Headers}
	}
}
