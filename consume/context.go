package consume

import (
	"context"
	"fmt"
	"time"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// routed is the handler's context: the parent's, with the decision and,
// as an enqueue.TokenSource, the token of the jobs the handler enqueues.
// Most handlers enqueue nothing, so that token is merged only when asked
// for, and not kept: merging again costs less than an enqueue. One
// allocation serves both, where context.WithValue would add another, and
// holds the decision's Databases too (newRouted).
type routed struct {
	context.Context
	r *Router
	d Decision
	// tok and now are the child token's inputs besides d: the job's token
	// and the decision time.
	tok position.Token
	now time.Time
}

// noDatabases is Decision.Databases of a job without a token: empty, not
// nil, and without room for appends, which go elsewhere.
var noDatabases = []DatabaseDecision{}

// newRouted allocates a routed and, in the same allocation for the one or
// two databases most tokens name, the buffer for its decision's
// Databases. Sized to the token, the common single database takes 352
// bytes rather than 512 (past 512, objects with pointers also need a
// malloc header).
func newRouted(databases int) (*routed, []DatabaseDecision) {
	switch databases {
	case 0:
		return &routed{}, noDatabases
	case 1:
		rc := &struct {
			routed
			small [1]DatabaseDecision
		}{}
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

// Value answers routedKey and leaves every other key to the parent.
func (rc *routed) Value(key any) any {
	if key == (routedKey{}) {
		return rc
	}
	return rc.Context.Value(key)
}

// String reads as context.WithValue's would.
func (rc *routed) String() string {
	parent := fmt.Sprintf("%T", rc.Context)
	if s, ok := rc.Context.(fmt.Stringer); ok {
		parent = s.String()
	}
	return parent + ".WithValue(consume.routedKey, *consume.routed)"
}

// childSource is routed as the enqueue.TokenSource of the handler's
// token; a type of its own, so that the context's String does not repeat
// itself.
type childSource routed

var _ enqueue.TokenSource = (*childSource)(nil)

func (s *childSource) Token() position.Token { return childToken(s.tok, &s.d, s.now) }

type routedKey struct{}

// DecisionFrom returns the decision of a context that came from Route.
func DecisionFrom(ctx context.Context) (Decision, bool) {
	rc, _ := ctx.Value(routedKey{}).(*routed)
	if rc == nil {
		return Decision{}, false
	}
	return rc.d, true
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
