package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/retry"
)

// minDeferDelay keeps a deferral that asks for no delay, or a run of
// failing replicas, from spinning.
const minDeferDelay = 10 * time.Millisecond

// process runs one record to its end: handled, republished to the retry
// topic, or dead-lettered. It returns false if ctx ended first; the
// record must then stay uncommitted, to be delivered again.
func (e *Engine[R, H]) process(ctx context.Context, r R, p *Partition[R, H]) bool {
	ok := e.run(ctx, r, p)
	if p.held {
		p.held = false
		p.src.Resume()
	}
	return ok
}

func (e *Engine[R, H]) run(ctx context.Context, r R, p *Partition[R, H]) bool {
	hs := e.lib.Headers(r)
	// The producer's trace continues here (unless ctx has a span of the
	// application's own): the routing spans and the handler's join it.
	ctx = e.traceContext(ctx, r, hs, p.traced)
	// The token is read once per record; every attempt routes it again.
	rt := e.readToken(ctx, r, *hs, p)
	attempts := 0
	if p.retry {
		n, _ := headerInt(*hs, HeaderAttempts)
		attempts = int(max(0, min(n, int64(e.cfg.MaxAttempts))))
		if due, ok := headerInt(*hs, HeaderDue); ok && time.Now().Before(time.UnixMilli(due)) {
			p.hold()
			if !e.untilDue(ctx, r, *hs, time.UnixMilli(due), &rt, p) {
				return false
			}
		}
	}
	for failedReplicas := 0; ; {
		hctx := ctx
		if attempts > 0 {
			hctx = context.WithValue(ctx, attemptKey{}, attempts)
		}
		rctx, err := e.attempt(hctx, r, &rt, p)
		if err == nil {
			p.add(resultHandled)
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		var de *consume.DeferError
		if errors.As(err, &de) {
			if e.cfg.Mode == RetryTopic {
				return e.deferToRetryTopic(ctx, r, *hs, de, attempts, p)
			}
			if !e.holdInPlace(ctx, r, de, &rt, p, rt.Verify == nil) {
				return false
			}
			continue
		}
		// The handler failed. A replica the router chose failing the
		// record (it could not be reached, or its connections kept
		// reaching servers behind the token: consume.ReplicaFailed) is the
		// router's failure, not the record's: the router has left that
		// replica out, so route the record again without spending an
		// attempt. A record that keeps meeting failing replicas is
		// deferred, still without one, by the router's first deferral
		// step; in place it sleeps that out rather than waiting for the
		// catch-up, which its token may have had already.
		if consume.ReplicaFailed(rctx) {
			p.add(resultRerouted)
			if failedReplicas++; failedReplicas <= consume.MaxReroutes {
				continue
			}
			failedReplicas = 0
			d, _ := consume.DecisionFrom(rctx)
			d.Waited = 0 // hold the delay: no route has just waited for this
			de := &consume.DeferError{Delay: e.cfg.Router.Config().DeferInitial, Decision: d}
			if e.cfg.Mode == RetryTopic {
				return e.deferToRetryTopic(ctx, r, *hs, de, attempts, p)
			}
			if !e.holdInPlace(ctx, r, de, &rt, p, false) {
				return false
			}
			continue
		}
		failedReplicas = 0
		attempts++
		if attempts >= e.cfg.MaxAttempts {
			return e.deadLetter(ctx, r, *hs, attempts, err, p)
		}
		delay := e.cfg.retryDelay(attempts)
		pl := e.lib.Place(r)
		e.log.WarnContext(ctx, e.name+": handler failed; retrying",
			slog.String("topic", pl.Topic), slog.Int("partition", int(pl.Partition)), slog.Int64("offset", pl.Offset),
			slog.Int("attempt", attempts), slog.Duration("delay", delay), slog.Any("error", err))
		p.add(resultRetried)
		if e.cfg.Mode == RetryTopic {
			return e.republish(ctx, r, *hs, time.Now().Add(delay), attempts, false)
		}
		p.hold()
		if !retry.Sleep(ctx, delay) {
			return false
		}
	}
}

// deferToRetryTopic republishes r, deferred by de, to the retry topic
// (RetryTopic mode), where it runs at its due time or at its catch-up.
// It returns whether r is done.
func (e *Engine[R, H]) deferToRetryTopic(ctx context.Context, r R, hs []H, de *consume.DeferError, attempts int, p *Partition[R, H]) bool {
	sctx, span := e.startDefer(ctx, de, RetryTopic, r)
	ok := e.republish(sctx, r, hs, time.Now().Add(max(de.Delay, minDeferDelay)), attempts, true)
	span.End()
	if ok {
		p.add(resultDeferred)
	}
	return ok
}

// holdInPlace holds r, deferred by de, at the head of its partition
// (InPlace mode) before it is routed again; false if ctx ended first.
// Route bounds the loop around it: once the token is older than the
// router's MaxAge it sends the record to the primary. When Route has just
// waited for a replica, that wait woke on the tracker's observations;
// asking again at once keeps waking within milliseconds of the catch-up
// rather than sleeping out a deferral step that may be seconds long.
// Otherwise (the cap, waiting disabled, no healthy replica, a tiny
// budget) it holds the delay, or with wake less if a replica can serve
// the token first (holdDeferred), so the loop never spins. Without wake it
// sleeps the delay: the position alone does not say a Verifier will vouch
// for the token, so waking on it could route again at once, again and
// again.
func (e *Engine[R, H]) holdInPlace(ctx context.Context, r R, de *consume.DeferError, rt *RecordToken, p *Partition[R, H], wake bool) bool {
	p.add(resultWaited)
	p.hold()
	if de.Decision.Waited >= minDeferDelay {
		return true
	}
	delay := max(de.Delay, minDeferDelay)
	sctx, span := e.startDefer(ctx, de, InPlace, r)
	held, woken := false, false
	if wake {
		held, woken = e.holdDeferred(sctx, time.Now().Add(delay), rt, p)
	} else {
		held = retry.Sleep(sctx, delay)
	}
	endHold(span, woken)
	return held
}

// readToken reads r's token: the adapter's Token, else the
// position.HeaderName headers through the partition's decoder.
func (e *Engine[R, H]) readToken(ctx context.Context, r R, hs []H, p *Partition[R, H]) RecordToken {
	if e.token != nil {
		return e.token(ctx, r)
	}
	tok, err := decodeToken(&p.dec, hs)
	return RecordToken{Token: tok, Err: err}
}

// attempt routes r, whose token is rt, through the partition's Tally and
// runs the handler with the routed context, which it returns with the
// handler's error. The error is Route's *consume.DeferError when no
// replica can serve the record yet.
func (e *Engine[R, H]) attempt(ctx context.Context, r R, rt *RecordToken, p *Partition[R, H]) (context.Context, error) {
	job := consume.Job{Token: rt.Token, TokenErr: rt.Err, Policy: e.cfg.Policy, Verify: rt.Verify}
	if rt.Err != nil {
		// Named only when the router has something to warn about: the
		// string allocates.
		job.Source = "kafka " + p.topic
	}
	rctx, _, err := p.tally.Route(ctx, job)
	if err != nil {
		return ctx, err
	}
	return rctx, e.call(rctx, r)
}

// call runs the handler, turning a panic into an error so that one bad
// record is retried and dead-lettered instead of killing the process.
func (e *Engine[R, H]) call(ctx context.Context, r R) (err error) {
	defer func() {
		if v := recover(); v != nil {
			e.log.ErrorContext(ctx, e.name+": handler panicked", slog.Any("panic", v),
				slog.String("stack", string(debug.Stack())))
			err = fmt.Errorf("%s: handler panicked: %v", e.name, v)
		}
	}()
	return e.handler(ctx, r)
}

// untilDue holds a retry-topic record until its due time, or, for a
// record deferred for lag (HeaderDeferred), until a replica has replayed
// its token if that comes first: the deferral's delay only stood in for
// "until a replica catches up". A record retried after a handler error
// waits out its backoff whatever the replicas do. It returns false if ctx
// ended first.
//
// Retry partitions are roughly in due order (each record is appended at
// now+delay), so waiting here for the head costs the records behind it
// little; a record behind the head waits for it even when its own token
// is caught up.
func (e *Engine[R, H]) untilDue(ctx context.Context, r R, hs []H, due time.Time, rt *RecordToken, p *Partition[R, H]) bool {
	if !headerHas(hs, HeaderDeferred) {
		return retry.Sleep(ctx, time.Until(due))
	}
	// Past its due time the record is routed once and, if still behind,
	// deferred again with a new due time: no loop, so even a token that a
	// Verifier vouches for may wake on its position.
	ctx, span := e.startWake(ctx, r)
	held, woken := e.holdDeferred(ctx, due, rt, p)
	endHold(span, woken)
	return held
}

// holdDeferred holds a record deferred for lag until deadline, or until
// a replica has replayed its token (consume.Router.WaitCaughtUp: exactly
// the replicas routing would choose) if that comes first, which counts as
// woken. A record without a readable token sleeps until deadline: its
// catch-up cannot be waited for. It returns false if ctx ended first, and
// whether the catch-up ended the hold.
func (e *Engine[R, H]) holdDeferred(ctx context.Context, deadline time.Time, rt *RecordToken, p *Partition[R, H]) (held, woken bool) {
	if rt.Err != nil || rt.Token.IsZero() {
		return retry.Sleep(ctx, time.Until(deadline)), false
	}
	if !time.Now().Before(deadline) {
		return ctx.Err() == nil, false
	}
	dctx, cancel := context.WithDeadline(ctx, deadline)
	err := e.cfg.Router.WaitCaughtUp(dctx, rt.Token)
	cancel()
	switch {
	case ctx.Err() != nil:
		return false, false
	case err == nil:
		p.add(resultWoken)
		return true, true
	}
	return true, false
}

// republish produces r to the retry topic, due at due, and waits for the
// broker's acknowledgement. The original is marked done only afterwards,
// so a crash in between delivers the original again and the retry topic
// gets a duplicate: nothing is lost. deferred marks a deferral for lag
// (HeaderDeferred), which runs as soon as a replica catches up.
func (e *Engine[R, H]) republish(ctx context.Context, r R, hs []H, due time.Time, attempts int, deferred bool) bool {
	pl := e.lib.Place(r)
	return e.publish(ctx, e.cfg.RetryTopic, r,
		retryHeaders(hs, pl.Topic, pl.Partition, pl.Offset, attempts, due.UnixMilli(), deferred))
}

// deadLetter hands a record that failed attempts times to the hook or the
// dead-letter topic, retrying until that succeeds or ctx ends: a record is
// never done unless it was handled or parked somewhere.
func (e *Engine[R, H]) deadLetter(ctx context.Context, r R, hs []H, attempts int, cause error, p *Partition[R, H]) bool {
	pl := e.lib.Place(r)
	e.log.ErrorContext(ctx, e.name+": handler failed on every attempt; dead-lettering the record",
		slog.String("topic", pl.Topic), slog.Int("partition", int(pl.Partition)), slog.Int64("offset", pl.Offset),
		slog.Int("attempts", attempts), slog.Any("error", cause))
	ok := false
	if e.cfg.DeadLetter != nil {
		for n := 1; ; n++ {
			err := e.cfg.DeadLetter(ctx, r, cause)
			if err == nil {
				ok = true
				break
			}
			if ctx.Err() != nil {
				break
			}
			e.log.WarnContext(ctx, e.name+": the dead-letter hook failed; calling it again", slog.Any("error", err))
			if !retry.Sleep(ctx, retry.Nth(n, 100*time.Millisecond, 10*time.Second)) {
				break
			}
		}
	} else {
		ok = e.publish(ctx, e.cfg.DeadLetterTopic, r,
			deadLetterHeaders(hs, pl.Topic, pl.Partition, pl.Offset, attempts, cause))
	}
	if ok {
		p.add(resultDeadLettered)
	}
	return ok
}

// publish produces r's key and value with headers hs to topic until the
// broker acknowledges it or ctx ends.
func (e *Engine[R, H]) publish(ctx context.Context, topic string, r R, hs []H) bool {
	for n := 1; ; n++ {
		err := e.lib.Produce(ctx, topic, r, hs)
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		e.log.WarnContext(ctx, e.name+": producing to a retry or dead-letter topic failed; retrying",
			slog.String("topic", topic), slog.Any("error", err))
		if !retry.Sleep(ctx, retry.Nth(n, 100*time.Millisecond, 10*time.Second)) {
			return false
		}
	}
}
