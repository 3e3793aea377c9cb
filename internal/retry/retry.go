// Package retry is caughtup's one rule for waiting between attempts: an
// exponential backoff (github.com/cenkalti/backoff) that never gives up
// by itself, and a sleep that ends with its context. The relays, the
// Kafka consumer, the feed subscriber and the router's deferral schedule
// all use it.
package retry

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Exponential is a backoff from initial, ×multiplier per step, capped at
// max, randomized by ±jitter (0 for none), that never stops
// (MaxElapsedTime 0) and reads no clock: without jitter its steps are a
// function of their number alone. It is a value, so that a pure caller
// (the router's deferral schedule) keeps it on its stack.
func Exponential(initial, max time.Duration, multiplier, jitter float64) backoff.ExponentialBackOff {
	b := backoff.ExponentialBackOff{
		InitialInterval:     initial,
		RandomizationFactor: jitter,
		Multiplier:          multiplier,
		MaxInterval:         max,
		Stop:                backoff.Stop,
		Clock:               fixedClock{},
	}
	b.Reset()
	return b
}

// Doubling is Exponential doubling without jitter: a handful of relay
// instances do not stampede, and a predictable pause is easier to read in
// logs.
func Doubling(initial, max time.Duration) backoff.ExponentialBackOff {
	return Exponential(initial, max, 2, 0)
}

// Jittered is Exponential doubling with ±50% jitter, for many clients
// reconnecting to one server at once (a fleet's routers to Redis).
func Jittered(initial, max time.Duration) backoff.ExponentialBackOff {
	return Exponential(initial, max, 2, 0.5)
}

// Steps is Exponential's schedule without jitter, as plain arithmetic:
// Next returns the intervals NextBackOff would (the same growth and the
// same cap), without the random draw and the clock read NextBackOff makes
// at every step even when it uses neither. It is for a pure caller in a
// hot path: the router's deferral schedule, walked once per deferred job.
// TestStepsIsExponential holds the two to one schedule.
type Steps struct {
	cur, max   time.Duration
	multiplier float64
}

// NewSteps starts the schedule of Exponential(initial, max, multiplier, 0).
func NewSteps(initial, max time.Duration, multiplier float64) Steps {
	return Steps{cur: initial, max: max, multiplier: multiplier}
}

// Next returns the schedule's next interval.
func (s *Steps) Next() time.Duration {
	d := s.cur
	// backoff's incrementCurrentInterval, overflow check included.
	if float64(s.cur) >= float64(s.max)/s.multiplier {
		s.cur = s.max
	} else {
		s.cur = time.Duration(float64(s.cur) * s.multiplier)
	}
	return d
}

// Nth is the nth delay (n ≥ 1) of Doubling(initial, max):
// initial·2^(n-1), capped at max.
func Nth(n int, initial, max time.Duration) time.Duration {
	b := Doubling(initial, max)
	d := b.NextBackOff()
	for i := 1; i < n && d < max; i++ {
		d = b.NextBackOff()
	}
	return d
}

// Sleep waits d, or until ctx ends; it reports whether ctx is still live.
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// fixedClock keeps the backoff's elapsed-time bookkeeping off the real
// clock (MaxElapsedTime is 0, so it is never consulted).
type fixedClock struct{}

func (fixedClock) Now() time.Time { return time.Time{} }
