package consume

import (
	"time"

	"github.com/caughtup/caughtup/position"
)

// Job is what Router.Route needs to know about one job: its token and
// policy, and the limits of the queue it comes from, so that the job is
// decided once and counted once.
type Job struct {
	// Token is the job's token; the zero Token means none, and the job
	// reads the primary (OutcomePrimaryNoToken).
	Token position.Token
	// TokenErr is the error of decoding the token (position.DecodeHeaders),
	// if any: the job then reads the primary as malformed
	// (ReasonMalformedToken) whatever Token holds, and the warning carries
	// the error.
	TokenErr error
	// Policy is the job's policy; PolicyDefault means
	// Config.DefaultPolicy.
	Policy Policy
	// Source names where the job comes from ("asynq email:send", "kafka
	// user-events") in warnings about what it carries, which are
	// rate-limited per source, so that one misbehaving producer is easy to
	// find and does not drown the others.
	Source string

	// Verify, if set, must confirm on the replica chosen that it shows
	// the job's writes, for tokens whose position is necessary but not
	// sufficient (a Debezium event's source.lsn); see Verifier. Jobs the
	// handler enqueues then inherit only what the replicas read had
	// replayed, never Token itself.
	Verify Verifier

	// DeferBy, if not zero, is when a deferral of the job must have ended
	// (an absolute deadline, less the queue's scheduling slack). A job that
	// no replica serves and whose deferral would end later is not deferred:
	// it reads the primary at once, under the fallback cap
	// (ReasonCannotDefer).
	DeferBy time.Time
	// NoDefer: the job cannot be deferred at all (an asynq task on its
	// last attempt, which any error archives); as DeferBy now.
	NoDefer bool
	// Hold: the job can be refused no more than deferred. When the
	// fallback cap refuses it the primary, Route holds it in process until
	// a replica serves it or the cap admits it, or ctx ends, rather than
	// return ErrCapped. A held job is still charged to the cap (and the
	// fleet budget) when it reads the primary: the cap is never exceeded,
	// and the job is not lost.
	Hold bool
}
