// Package conformance is the freshness suite every queue adapter passes:
// the asynq and the Kafka adapter run the same scenarios against the real
// replicated cluster, as Watermill's pub/sub tests and River's driver suite
// do for their adapters.
//
// An adapter's test implements Driver over its own producer and consumer and
// calls Run. The suite owns the database, the router, the fault injection
// (paused replay) and the checker that compares what each job read with what
// its producer wrote.
package conformance

import (
	"context"

	"github.com/caughtup/caughtup/consume"
)

// Job is what the suite sends through an adapter: an id that names a row
// the producer wrote just before, and a key for adapters that order by key.
type Job struct {
	ID  int64
	Key string
}

// Handler is the suite's job handler. The adapter calls it with the
// context its middleware or decorator produced, so consume.DB and
// consume.DecisionFrom work in it. An error is a real handler error.
type Handler func(ctx context.Context, job Job) error

// Driver connects the suite to one adapter. A Driver is used by one test;
// NewDriver makes a fresh one (its own queue or topic) per test.
type Driver interface {
	// Produce sends job stamped the way users stamp: with the token that
	// ctx carries (enqueue.TokenFrom), through the adapter's producer.
	Produce(ctx context.Context, job Job) error
	// ProduceRaw sends job with header as the raw token header value,
	// bypassing stamping; "" sends no header at all. It exercises missing
	// and malformed tokens.
	ProduceRaw(ctx context.Context, job Job, header string) error
	// Consume starts the adapter's consumer with router and policy and
	// calls handle for each job until stop is called. stop returns once
	// the consumer has shut down; jobs not yet acknowledged may be
	// delivered again by a later Consume (at-least-once).
	Consume(ctx context.Context, router *consume.Router, policy consume.Policy, handle Handler) (stop func() error, err error)
}

// RetryCounter is implemented by drivers whose queue counts failed
// attempts (asynq's retry count). The suite checks that a deferral never
// counts as one.
type RetryCounter interface {
	// RetryCount returns the attempt count of the job being handled in ctx.
	RetryCount(ctx context.Context) int
}

// DeadLetterCounter is implemented by drivers whose queue sets a job
// aside after its last failed attempt (asynq archives it, the Kafka
// consumer writes it to the dead-letter topic). The suite checks that no
// job of a scenario ended there.
type DeadLetterCounter interface {
	// DeadLettered returns how many of this driver's jobs the queue has
	// set aside so far.
	DeadLettered(ctx context.Context) (int, error)
}
