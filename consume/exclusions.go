package consume

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/replay"
)

// What this process's handlers find, the tracker may not: a replica that
// the feed (or the tracker's own connection) calls healthy can be out of
// reach of the handlers' pool (a firewall, a proxy that refuses, a
// password rotated on one side), or its connections can keep reaching a
// server behind the job (a balancer whose choice moved). Each such failed
// acquire excludes the replica from this router's decisions for
// exclusionFor after the last one: its jobs go to another replica, wait,
// are deferred or read the primary under the cap, instead of failing
// against it attempt after attempt until the queue dead-letters them.

// ErrUnreachable is the Err a Router's Snapshot shows for a replica its
// handlers could not connect to within the last exclusionFor; it wraps the
// connection error.
var ErrUnreachable = errors.New("caughtup/consume: this process's handlers cannot reach the replica")

// exclusionFor is how long a replica stays out of this router's decisions
// after its handlers' last failed acquire: long enough that the jobs
// retried next go elsewhere, short enough that a replica back in reach is
// used again within about a second.
const exclusionFor = time.Second

type exclusion struct {
	until time.Time
	err   error
}

// exclusions are a Router's replicas out of its decisions, laid over the
// tracker's snapshots.
type exclusions struct {
	latest atomic.Int64 // UnixNano of the latest until: nothing is excluded past it
	mu     sync.Mutex
	by     map[[2]string]exclusion // database, replica name
	cached atomic.Pointer[overlay]
}

type overlay struct {
	base  *replay.Snapshot
	snap  *replay.Snapshot
	valid time.Time // the overlay holds until the first exclusion in it ends
	gen   uint64
}

// exclude takes replica out of database's decisions until
// exclusionFor after now, and reports whether it was not out already.
func (x *exclusions) exclude(database, replica string, now time.Time, err error) bool {
	until := now.Add(exclusionFor)
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.by == nil {
		x.by = make(map[[2]string]exclusion)
	}
	k := [2]string{database, replica}
	prev, had := x.by[k]
	x.by[k] = exclusion{until: until, err: err}
	if until.UnixNano() > x.latest.Load() {
		x.latest.Store(until.UnixNano())
	}
	x.cached.Store(nil)
	return !had || !prev.until.After(now)
}

// apply returns s with the replicas excluded at now marked failing.
func (x *exclusions) apply(s *replay.Snapshot, now time.Time) *replay.Snapshot {
	if now.UnixNano() >= x.latest.Load() {
		return s
	}
	if o := x.cached.Load(); o != nil && o.base == s && now.Before(o.valid) {
		return o.snap
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	out, valid := s, time.Time{}
	for k, e := range x.by {
		if !e.until.After(now) {
			continue
		}
		if valid.IsZero() || e.until.Before(valid) {
			valid = e.until
		}
		for db := range s.Databases {
			if s.Databases[db].Name != k[0] {
				continue
			}
			for idx := range s.Databases[db].Replicas {
				if s.Databases[db].Replicas[idx].Name == k[1] {
					out = out.WithReplicaErr(db, idx, e.err)
				}
			}
		}
	}
	if !valid.IsZero() {
		x.cached.Store(&overlay{base: s, snap: out, valid: valid})
	}
	return out
}

// snapshot is the tracker's snapshot with this router's exclusions.
func (r *Router) snapshot() *replay.Snapshot { return r.snapshotAt(r.cfg.Now()) }

// snapshotAt is snapshot with the exclusions at now, for a caller that
// has read the clock already: a clock read is a noticeable share of a
// routed message's cost (BenchmarkTallyRoute).
func (r *Router) snapshotAt(now time.Time) *replay.Snapshot {
	return r.excluded.apply(r.tr.Snapshot(), now)
}

// acquireTracer watches the acquires of one replica's handler pool: a
// failed one that is not the caller's doing excludes the replica.
type acquireTracer struct {
	ch *connCheck
}

var (
	_ pgxpool.AcquireTracer = acquireTracer{}
	_ pgx.QueryTracer       = acquireTracer{}
)

func (acquireTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

// TraceQueryEnd: a query that failed because its connection broke (the
// server, or what stands before it, went away under an idle connection)
// counts as a failed acquire: the next connection would have to be a new
// one, and may not come.
func (t acquireTracer) TraceQueryEnd(ctx context.Context, c *pgx.Conn, data pgx.TraceQueryEndData) {
	if data.Err != nil && c != nil && c.IsClosed() {
		t.failed(ctx, data.Err)
	}
}

func (acquireTracer) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	return ctx
}

func (t acquireTracer) TraceAcquireEnd(ctx context.Context, _ *pgxpool.Pool, data pgxpool.TraceAcquireEndData) {
	if data.Err != nil {
		t.failed(ctx, data.Err)
	}
}

// failed excludes the replica for a failure that is not the caller's doing.
func (t acquireTracer) failed(ctx context.Context, failure error) {
	if ctx.Err() != nil || errors.Is(failure, context.Canceled) || errors.Is(failure, context.DeadlineExceeded) {
		return
	}
	data := struct{ Err error }{failure}
	var err error
	var ce *pgconn.ConnectError
	var ne net.Error
	reason := "behind"
	switch {
	case errors.Is(data.Err, ErrReplicaBehind):
		err = data.Err
	case errors.As(data.Err, &ce), errors.As(data.Err, &ne), errors.Is(data.Err, io.ErrUnexpectedEOF), errors.Is(data.Err, io.EOF), errors.Is(data.Err, net.ErrClosed):
		err, reason = fmt.Errorf("%w: %w", ErrUnreachable, data.Err), "unreachable"
	default:
		return // the application's hook refused, or the like
	}
	ch := t.ch
	if ch.r.excluded.exclude(ch.db, ch.name, ch.r.cfg.Now(), err) {
		ch.r.met.exclusion(ctx, ch.db, ch.name, reason)
		ch.r.log.LogAttrs(ctx, slog.LevelWarn, "caughtup: this process's handlers cannot use the replica; it is left out of this router's decisions until a second passes without a failure",
			slog.String(attrDatabase, ch.db), slog.String(attrReplica, ch.name), slog.Any("error", err))
	}
}
