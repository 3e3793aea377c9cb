package consume

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/position"
)

// counter names the Router's counters that a Tally batches.
type counter uint8

const (
	counterDecisions counter = iota
	counterRoutes
	counterMissing
	counterCrossEpoch
	counterFuture
)

func (m *metrics) counter(c counter) metric.Int64Counter {
	switch c {
	case counterRoutes:
		return m.routes
	case counterMissing:
		return m.missing
	case counterCrossEpoch:
		return m.crossEpoch
	case counterFuture:
		return m.future
	}
	return m.decisions
}

const numCounters = int(counterFuture) + 1

// A Tally routes jobs exactly as its Router does, but keeps the counts of
// their decisions (caughtup.consume.decisions, …database.routes,
// …tokens.missing, …tokens.cross_epoch, …tokens.future) until Flush adds
// them to the router's counters in bulk. It is for adapters whose job rate
// makes a counter Add per job a noticeable share of a job's cost: an
// OpenTelemetry SDK Add costs a few hundred nanoseconds, and a Route
// records two or more, while a Kafka consumer with a trivial handler
// spends about a microsecond per message of its own. The wait histogram
// is recorded at once, and logs are the Router's.
//
// The adapter must Flush regularly (the Kafka consumer does at every
// offset commit) and when it stops, or the counts are late or lost. A
// Tally is safe for concurrent use, but meant for one worker goroutine
// and the one that flushes it; its lock is then uncontended.
type Tally struct {
	r  *Router
	mu sync.Mutex
	n  [numCounters]map[*measurement]int64
}

// NewTally returns a Tally of r.
func (r *Router) NewTally() *Tally {
	t := &Tally{r: r}
	for c := range t.n {
		t.n[c] = make(map[*measurement]int64)
	}
	return t
}

// RouteDecoded is Router.RouteDecoded, counted in t.
func (t *Tally) RouteDecoded(ctx context.Context, tok position.Token, decodeErr error, policy Policy) (context.Context, Decision, error) {
	if decodeErr != nil {
		tok = position.Token{}
	}
	return t.r.route(ctx, tok, decodeErr, policy, nil, t)
}

// RouteVerified is Router.RouteVerified, counted in t.
func (t *Tally) RouteVerified(ctx context.Context, tok position.Token, decodeErr error, policy Policy, verify Verifier) (context.Context, Decision, error) {
	if verify == nil {
		return ctx, Decision{}, errNoVerifier
	}
	if decodeErr != nil {
		tok = position.Token{}
	}
	return t.r.route(ctx, tok, decodeErr, policy, verify, t)
}

// Flush adds what t counted since the last Flush to the router's
// counters. ctx's values (not its cancellation) go to the instruments.
func (t *Tally) Flush(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	t.mu.Lock()
	defer t.mu.Unlock()
	for c, counts := range t.n {
		for set, n := range counts {
			if n != 0 {
				t.r.met.counter(counter(c)).Add(ctx, n, set.add...)
				counts[set] = 0
			}
		}
	}
}
