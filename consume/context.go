package consume

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replicapool"
)

// routing is what Route puts in the handler's context under routingKey:
// the router, the decision and what the child token needs besides.
//
// The job's token is not kept: its entries are the decision's
// (DatabaseDecision.Entry, in the token's order), and jobToken puts them
// back together with captured when a handler enqueues. So Route keeps
// nothing of the token it was given, whose entries may be a buffer the
// caller reuses (position.HeaderDecoder).
type routing struct {
	// src is who routed the job: its Router, and its Tally if any,
	// which counts what the job's replica connections met.
	src *routeSource
	d   Decision
	// captured is the job token's CapturedAt; now is the decision time.
	captured time.Time
	now      time.Time
	// attempt is what the job's acquires met on the replica pools
	// (connections.go).
	attempt replicapool.Attempt
}

type routingKey struct{}

// routeSource is who routed a job: a Router (Router.direct), or a Tally
// of it (Tally.src). One pointer in every handler context names both.
type routeSource struct {
	r *Router
	t *Tally // nil: routed by the Router itself
}

// routed is the handler's context: its parent with the routing under
// routingKey, as context.WithValue(parent, routingKey{}, &routing) would
// give, and the child token's source, as enqueue.WithTokenSource would
// add, in the routing's own allocation. At a Kafka consumer's message rate
// each context that WithValue adds is a noticeable share of what a message
// costs, most of it in the garbage collector (see BenchmarkTallyRoute).
// Everything but Value and String is the parent's, so cancellation,
// deadlines, context.Cause and AfterFunc behave as through a valueCtx
// (TestRoutedContext).
type routed struct {
	enqueue.SourceContext // the parent, carrying the child token's source
	routing
}

// Value answers routingKey and leaves every other key to the
// SourceContext, which answers the child token's.
func (c *routed) Value(key any) any {
	if _, ok := key.(routingKey); ok {
		return &c.routing
	}
	return c.SourceContext.Value(key)
}

// String reads as context.WithValue's and enqueue.WithTokenSource's would.
func (c *routed) String() string {
	parent := fmt.Sprintf("%T", c.Context)
	if s, ok := c.Context.(fmt.Stringer); ok {
		parent = s.String()
	}
	// The SourceContext's text is the parent's and what it adds.
	added, _ := strings.CutPrefix(c.SourceContext.String(), parent)
	return parent + ".WithValue(consume.routingKey, *consume.routing)" + added
}

// noDatabases is Decision.Databases of a job without a token: empty, not
// nil, and without room for appends, which go elsewhere.
var noDatabases = []DatabaseDecision{}

// newRouted allocates a routed and, in the same allocation for one or
// two databases, the buffer for its decision's Databases. A Tally's
// one-database contexts, a consumer's usual case, come from a batch
// (Tally.nextRouted).
func newRouted(databases int, t *Tally) (*routed, []DatabaseDecision) {
	switch databases {
	case 0:
		return &routed{}, noDatabases
	case 1:
		var rc *routedOne
		if t != nil {
			rc = t.nextRouted()
		} else {
			rc = &routedOne{}
		}
		return &rc.routed, rc.small[:0]
	case 2:
		rc := &struct {
			routed
			small [2]DatabaseDecision
		}{}
		return &rc.routed, rc.small[:0]
	}
	return &routed{}, make([]DatabaseDecision, 0, databases)
}

// routedOne is a routed with room for one database's decision.
type routedOne struct {
	routed
	small [1]DatabaseDecision
}

// routedBatch is how many contexts a Tally allocates at once: a batch
// pays the allocator's fixed cost once for 9 jobs (about 40 ns a job,
// BenchmarkTallyRoute), though the bytes to clear and collect stay the
// same. Nine contexts of 296 bytes and the counter fill the allocator's
// 2688-byte size class, which eight would leave 312 bytes short of
// (TestRoutedSlabFillsSizeClass). A handler that keeps its context keeps
// its batch (2.7 KB) alive, not just its own 296 bytes.
const routedBatch = 9

// routedSlab is a batch of contexts; next hands each out once.
type routedSlab struct {
	items [routedBatch]routedOne
	next  atomic.Int32
}

// jobToken is the token the job was routed with: the decision's entries
// and captured, in entries, which has room for them (their order is the
// token's). Only a decision for a token (no decode error) has Databases,
// one per entry.
func (rv *routing) jobToken(entries []position.Entry) position.Token {
	if len(rv.d.Databases) == 0 {
		return position.Token{}
	}
	entries = entries[:len(rv.d.Databases):len(rv.d.Databases)]
	for i := range rv.d.Databases {
		entries[i] = rv.d.Databases[i].Entry
	}
	return position.Token{Entries: entries, CapturedAt: rv.captured}
}

// handlerContext is parent with rc's routing and the child token: for a
// job with a token, that token as an enqueue.TokenSource, since most
// handlers enqueue nothing, so it is merged only when asked for
// (enqueue.TokenFrom), and not kept, as merging again costs less than an
// enqueue. A verified job's child token (readPositions) is not lazy:
// such jobs are few.
func handlerContext(parent context.Context, rc *routed, verified bool) context.Context {
	switch {
	case verified:
		rc.Init(parent, nil)
		return enqueue.WithToken(rc, readPositions(&rc.d, rc.now))
	case len(rc.d.Databases) == 0:
		rc.Init(parent, nil)
	default:
		rc.Init(parent, (*childSource)(&rc.routing))
	}
	return rc
}

// routingFrom returns what Route put in ctx, or nil.
func routingFrom(ctx context.Context) *routing {
	rv, _ := ctx.Value(routingKey{}).(*routing)
	return rv
}

// childSource is a routing as the enqueue.TokenSource of the child token.
type childSource routing

var _ enqueue.TokenSource = (*childSource)(nil)

// Token merges the child token when enqueue first asks for it. The
// job's token and what the replicas read take one allocation, the merge
// another.
func (s *childSource) Token() position.Token {
	rv := (*routing)(s)
	n, reads := len(rv.d.Databases), 0
	for i := range rv.d.Databases {
		if rv.d.Databases[i].replica >= 0 {
			reads++
		}
	}
	buf := make([]position.Entry, n+reads)
	return childTokenInto(rv.jobToken(buf[:n]), &rv.d, rv.now, buf[n:n])
}

// DecisionFrom returns the decision of a context that came from Route.
// Its Databases are the context's own (the child token is made from them,
// and a Tally's next job may repeat them): read them, do not modify them.
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
	return childTokenInto(tok, d, now, nil)
}

// childTokenInto is childToken with the replicas' positions appended to
// read (which may have room for them).
func childTokenInto(tok position.Token, d *Decision, now time.Time, read []position.Entry) position.Token {
	if tok.IsZero() {
		return tok
	}
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
