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

// ErrPrimaryBehind is matched by a *DeferError refused for
// ReasonPrimaryBehind: the job's token is from a newer timeline than the
// router's primary (a failover it has not seen: its primary pool may still
// reach the old primary), no replica has replayed it, and the old primary
// lacks its writes. Retry it as a failed attempt; point the primary pool
// at the new primary.
var ErrPrimaryBehind = errors.New("caughtup/consume: the job's token is ahead of the router's primary")

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
	switch {
	case e.Decision.Reason == ReasonPrimaryBehind && e.Refused():
		return fmt.Sprintf("caughtup/consume: job refused: its token is from a newer timeline than the router's primary (a failover the router has not seen), and no replica has replayed it; retry in %v, and point the primary pool at the new primary", e.Delay)
	case e.Decision.Outcome == OutcomeCapped:
		return fmt.Sprintf("caughtup/consume: job capped: it needs the primary but the fallback cap (Config.PrimaryRate) is exhausted; retry in %v", e.Delay)
	}
	return fmt.Sprintf("caughtup/consume: job deferred (%s): no replica has replayed its token yet; run it again in %v", e.Decision.Reason, e.Delay)
}

// Is matches ErrDeferred, ErrCapped for OutcomeCapped and
// ErrPrimaryBehind for a refusal for ReasonPrimaryBehind.
func (e *DeferError) Is(target error) bool {
	switch target {
	case ErrDeferred:
		return true
	case ErrCapped:
		return e.Decision.Outcome == OutcomeCapped
	case ErrPrimaryBehind:
		return e.Refused() && e.Decision.Reason == ReasonPrimaryBehind
	}
	return false
}

// Capped reports whether the job was refused by the fallback cap.
func (e *DeferError) Capped() bool { return e.Decision.Outcome == OutcomeCapped }

// Refused reports whether the job was refused (ActionRefuse: the cap, or a
// token ahead of the router's primary) rather than deferred for lag: retry
// it as a failed attempt.
func (e *DeferError) Refused() bool { return e.Decision.Action == ActionRefuse }

// ErrNotRouted is returned by Pool and SQLDB for a context that did not
// come from Router.Route: a handler that is
// not wrapped in an adapter's middleware, or a context made elsewhere.
var ErrNotRouted = errors.New("caughtup/consume: the context was not routed: wrap the handler in the adapter's middleware (caughtupasynq.Middleware, caughtupkafka.NewConsumer with a Router) or call Router.Route")

// ErrUnknownDatabase is returned by Pool and SQLDB for a database name
// that is not in the router's Config.Databases.
var ErrUnknownDatabase = errors.New("caughtup/consume: unknown database")
