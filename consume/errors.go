package consume

import (
	"errors"
	"fmt"
	"time"
)

// ErrDeferred is matched (errors.Is) by every *DeferError: the job did not
// run and should run again after DeferError.Delay.
var ErrDeferred = errors.New("caughtup/consume: job deferred")

// ErrCapped is matched by a *DeferError whose outcome is OutcomeCapped:
// the job needs the primary, the fallback cap is exhausted and the job may
// not be deferred any longer. Retry it as a failed attempt, or raise
// Config.PrimaryRate.
var ErrCapped = errors.New("caughtup/consume: primary fallback capped")

// DeferError is what Route returns instead of running a job that no
// replica can serve yet (ActionDefer) or that the cap keeps off the
// primary (ActionRefuse). It is a control error, like asynq's SkipRetry:
// the job is fine, only early.
type DeferError struct {
	// Delay is when to try again: the deferral delay, or for
	// OutcomeCapped a suggestion.
	Delay time.Duration
	// Decision is the decision that kept the job from running, for logs
	// and for adapters that pick their own retry delay.
	Decision Decision
}

// Error says why the job did not run and when to run it again.
func (e *DeferError) Error() string {
	if e.Decision.Outcome == OutcomeCapped {
		return fmt.Sprintf("caughtup/consume: job capped: it needs the primary but the fallback cap (Config.PrimaryRate) is exhausted; retry in %v", e.Delay)
	}
	return fmt.Sprintf("caughtup/consume: job deferred (%s): no replica has replayed its token yet; run it again in %v", e.Decision.Reason, e.Delay)
}

// Is matches ErrDeferred, and ErrCapped for OutcomeCapped.
func (e *DeferError) Is(target error) bool {
	return target == ErrDeferred || (target == ErrCapped && e.Decision.Outcome == OutcomeCapped)
}

// Capped reports whether the job was refused by the fallback cap rather
// than deferred for lag.
func (e *DeferError) Capped() bool { return e.Decision.Outcome == OutcomeCapped }

// ErrNotRouted is returned by Pool and SQLDB for a context that did not
// come from Router.Route (or RouteToken, RouteDecoded): a handler that is
// not wrapped in an adapter's middleware, or a context made elsewhere.
var ErrNotRouted = errors.New("caughtup/consume: the context was not routed: wrap the handler in the adapter's middleware (caughtupasynq.Middleware, caughtupkafka.NewConsumer with a Router) or call Router.Route")

// ErrUnknownDatabase is returned by Pool and SQLDB for a database name
// that is not in the router's Config.Databases.
var ErrUnknownDatabase = errors.New("caughtup/consume: unknown database")
