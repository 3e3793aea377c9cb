package consume

import (
	"context"
	"time"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// routing is what Route puts in the handler's context (context.WithValue
// under routingKey): the router, the decision and what the child token
// needs besides. The same allocation holds the decision's Databases for
// the one or two databases most tokens name (newRouting).
//
// The job's token is not kept: its entries are the decision's
// (DatabaseDecision.Entry, in the token's order), and jobToken puts them
// back together with captured when a handler enqueues. So Route keeps
// nothing of the token it was given, whose entries may be a buffer the
// caller reuses (position.HeaderDecoder).
type routing struct {
	r *Router
	d Decision
	// captured is the job token's CapturedAt; now is the decision time.
	captured time.Time
	now      time.Time
	// verified: the token's positions were vouched for by a Verifier
	// (RouteVerified) and are not safe to pass on; children inherit only
	// what the replicas read had replayed (readPositions).
	verified bool
}

type routingKey struct{}

// noDatabases is Decision.Databases of a job without a token: empty, not
// nil, and without room for appends, which go elsewhere.
var noDatabases = []DatabaseDecision{}

// newRouting allocates a routing and, in the same allocation for one or
// two databases, the buffer for its decision's Databases.
func newRouting(databases int) (*routing, []DatabaseDecision) {
	switch databases {
	case 0:
		return &routing{}, noDatabases
	case 1:
		rv := &struct {
			routing
			small [1]DatabaseDecision
		}{}
		return &rv.routing, rv.small[:0]
	case 2:
		rv := &struct {
			routing
			small [2]DatabaseDecision
		}{}
		return &rv.routing, rv.small[:0]
	}
	return &routing{}, make([]DatabaseDecision, 0, databases)
}

// jobToken is the token the job was routed with: the decision's entries
// and captured. Only a decision for a token (no decode error) has
// Databases, one per entry.
func (rv *routing) jobToken() position.Token {
	if len(rv.d.Databases) == 0 {
		return position.Token{}
	}
	entries := make([]position.Entry, len(rv.d.Databases))
	for i := range rv.d.Databases {
		entries[i] = rv.d.Databases[i].Entry
	}
	return position.Token{Entries: entries, CapturedAt: rv.captured}
}

// hasChild reports whether the child token is non-zero.
func (rv *routing) hasChild() bool {
	if !rv.verified {
		return len(rv.d.Databases) > 0
	}
	for i := range rv.d.Databases {
		if rv.d.Databases[i].replica >= 0 {
			return true
		}
	}
	return false
}

// handlerContext is ctx with rv and, for a job with a child token, that
// token as an enqueue.TokenSource: most handlers enqueue nothing, so the
// child token is merged only when asked for (enqueue.TokenFrom), and not
// kept, since merging again costs less than an enqueue.
func handlerContext(ctx context.Context, rv *routing) context.Context {
	ctx = context.WithValue(ctx, routingKey{}, rv)
	if !rv.hasChild() {
		return ctx
	}
	return enqueue.WithTokenSource(ctx, (*childSource)(rv))
}

// routingFrom returns what Route put in ctx, or nil.
func routingFrom(ctx context.Context) *routing {
	rv, _ := ctx.Value(routingKey{}).(*routing)
	return rv
}

// childSource is a routing as the enqueue.TokenSource of the child token.
type childSource routing

var _ enqueue.TokenSource = (*childSource)(nil)

// Token merges the child token when enqueue first asks for it.
func (s *childSource) Token() position.Token {
	rv := (*routing)(s)
	if rv.verified {
		return readPositions(&rv.d, rv.now)
	}
	return childToken(rv.jobToken(), &rv.d, rv.now)
}

// DecisionFrom returns the decision of a context that came from Route.
func DecisionFrom(ctx context.Context) (Decision, bool) {
	rv := routingFrom(ctx)
	if rv == nil {
		return Decision{}, false
	}
	return rv.d, true
}

// childToken is what jobs enqueued by the handler must carry: the job's
// token, raised to what each replica read had replayed (never lower, by
// Merge). When every database was read from a replica, every entry is a
// position captured now, so the child's age starts now.
func childToken(tok position.Token, d *Decision, now time.Time) position.Token {
	if tok.IsZero() {
		return tok
	}
	var reads [2]position.Entry
	read := reads[:0]
	all := true
	for _, dd := range d.Databases {
		if dd.replica < 0 {
			all = false
			continue
		}
		read = append(read, position.Entry{Database: dd.Database, Epoch: dd.ReadAt.Epoch, LSN: dd.ReadAt.LSN, Source: position.SourceReplica})
	}
	if len(read) == 0 {
		return tok
	}
	out := tok.Merge(position.Token{Entries: read, CapturedAt: now})
	if all && len(read) == len(tok.Entries) {
		out.CapturedAt = now
	}
	return out
}

type sourceKey struct{}

// WithSource names where the jobs routed with ctx come from ("asynq
// email:send", "kafka user-events"): warnings about what those jobs
// carry (a malformed token) name it and are rate-limited per source, so
// that one misbehaving producer is easy to find and does not drown the
// others. Adapters call it only when there is something to warn about,
// since it costs an allocation.
func WithSource(ctx context.Context, source string) context.Context {
	return context.WithValue(ctx, sourceKey{}, source)
}

// sourceFrom returns the source WithSource put in ctx, or "".
func sourceFrom(ctx context.Context) string {
	s, _ := ctx.Value(sourceKey{}).(string)
	return s
}
