package consume

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/replicapool"
)

// Router routes jobs: one per process, shared by every worker goroutine.
// It owns the tracker's goroutines and connections (one per node), not
// the application's pools.
type Router struct {
	cfg    Config
	tr     positions
	gate   *fallbackGate // the per-process cap and the fleet budget (budget.go)
	met    *metrics
	tracer trace.Tracer
	log    *slog.Logger
	spread spreadCounter
	// direct is the routeSource of jobs routed by the Router itself.
	direct routeSource
	// tallies numbers the Tallies, whose jobs spread from a replica of
	// their own (Tally.home).
	tallies atomic.Uint32
	pools   map[string]*replay.Database
	// sqlDBs serve SQLDB: one *sql.DB per pool, opened at start.
	sqlDBs map[*pgxpool.Pool]*sql.DB
	// handlers are the replica pools the router built for its handlers
	// (connections.go); poolGen changes whenever what the overlay derives
	// from them may have (overlay.go), whose latest result is overlaid.
	handlers handlerPools
	poolGen  atomic.Uint64
	overlaid atomic.Pointer[overlay]

	warns warnings

	closeOnce sync.Once
}

// spreadCounter is the counter that spreads jobs over caught-up replicas,
// alone on its cache line. Every job adds to it, from every core: beside
// the Router's other fields, which every job reads, each add would also
// take those from the other cores' caches (about 60 ns a job from two
// workers routing at once, BenchmarkTallyRouteParallel).
type spreadCounter struct {
	_ [cacheLine]byte
	atomic.Uint32
	_ [cacheLine - 4]byte
}

// spreadFor is the Spread of a job routed through t (nil: none). A
// Tally's jobs (a Kafka partition's worker, which runs one at a time) all
// take the caught-up replica at its home: one worker, one replica, while
// the workers share the replicas out. Its connections then stay with one
// server, and each server's sessions see a steady stream rather than every
// other query: with a point query per record on 4 partitions over 2
// replicas, alternating each worker's queries between the replicas cost
// 17–50% more CPU per query, in the client and on the servers, than each
// worker staying on one (BenchmarkThroughputQuery's bare sides, spread
// against spread-turns, in kafka/caughtupkgo; docs/performance.md). Other jobs (many handlers at once, each running one
// job) take one counter, so that the jobs in flight at any moment
// alternate between the replicas; a random pick per job, or a counter
// per worker that alternates each worker's jobs, did worse.
func (r *Router) spreadFor(t *Tally) uint32 {
	if t != nil {
		return t.home
	}
	return r.spread.Add(1)
}

// positions is what the Router needs of its tracker: a *replay.Tracker,
// or in unit tests a fixed snapshot.
type positions interface {
	Snapshot() *replay.Snapshot
	Watch(database string) (stop func())
	Close() error
}

var _ positions = (*replay.Tracker)(nil)

// cacheLine is the size of a cache line on amd64 and most arm64 cores.
const cacheLine = 64

// NewRouter validates cfg, starts the tracker (replay.NewTracker) and
// waits until every node has been queried once (or ctx ends, or the
// tracker's StalenessBound passes: nodes that have not answered by then
// count as unknown, and jobs fall back to the primary until they do). ctx
// bounds only this start; the tracker runs until Close.
func NewRouter(ctx context.Context, cfg Config) (*Router, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	r, err := newRouter(cfg)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Router, error) {
		_ = r.Close()
		return nil, err
	}
	if r.met, err = newMetrics(cfg.MeterProvider, r.cfg.Databases); err != nil {
		return fail(fmt.Errorf("caughtup/consume: creating instruments: %w", err))
	}
	if r.gate, err = newFallbackGate(&r.cfg, r.log); err != nil {
		return fail(fmt.Errorf("caughtup/consume: creating instruments: %w", err))
	}
	if r.tr, err = replay.NewTracker(ctx, r.cfg.Databases, r.cfg.Tracker); err != nil {
		return fail(err)
	}
	return r, nil
}

// newRouter is a Router for cfg (defaults applied) without its metrics
// and tracker, with the pools it hands handlers for each replica
// (connections.go) built from the configured ones' configs. They connect
// nothing until a handler needs a connection.
func newRouter(cfg Config) (*Router, error) {
	// Copy what the tracker and DB read, so the caller's map and slices
	// may change afterwards.
	cfg.Databases = maps.Clone(cfg.Databases)
	pools := make(map[string]*replay.Database, len(cfg.Databases))
	r := &Router{
		cfg:      cfg,
		log:      cfg.Logger,
		tracer:   newTracer(cfg.TracerProvider),
		pools:    pools,
		sqlDBs:   make(map[*pgxpool.Pool]*sql.DB),
		handlers: make(handlerPools, len(cfg.Databases)),
	}
	r.direct.r = r
	for name, db := range cfg.Databases {
		db.Replicas = slices.Clone(db.Replicas)
		cfg.Databases[name] = db
		given := db
		given.Replicas = slices.Clone(db.Replicas)
		hps := make([]*replicapool.Pool, len(given.Replicas))
		for i, rep := range given.Replicas {
			if rep.Pool == nil {
				continue // a unit test's router over a fixed snapshot
			}
			hp, err := r.handlerPool(name, i, rep)
			if err != nil {
				r.closePools()
				return nil, fmt.Errorf("caughtup/consume: database %q replica %q: the handlers' pool: %w", name, rep.Name, err)
			}
			given.Replicas[i].Pool = handed(hp)
			hps[i] = hp
		}
		r.handlers[name] = hps
		pools[name] = &given
	}
	r.cfg.Databases = cfg.Databases
	for _, db := range pools {
		r.openSQL(db.Primary)
		for _, rep := range db.Replicas {
			r.openSQL(rep.Pool)
		}
	}
	return r, nil
}

// closePools closes the *sql.DBs that SQLDB hands out, then the handler
// pools the router built; not the application's pools.
func (r *Router) closePools() error {
	err := r.closeSQL()
	r.handlers.closeAll()
	return err
}

// Close stops the tracker's goroutines and closes its connections. It
// does not close the application's pools. Routing after Close still works
// but, with the tracker stopped, every replica soon counts as stale. The
// tracker's gauges end with it (their callback is unregistered); the
// counts are synchronous instruments whose sums the MeterProvider keeps,
// so a collection after Close (at MeterProvider.Shutdown) still reports
// every job, and a Router made next on the same MeterProvider adds to the
// same series.
func (r *Router) Close() error {
	var err error
	r.closeOnce.Do(func() {
		if r.tr != nil {
			err = r.tr.Close()
		}
		err = errors.Join(err, r.closePools())
	})
	return err
}

// closeSQL closes the *sql.DBs that SQLDB hands out; not the pools under
// them.
func (r *Router) closeSQL() error {
	var err error
	for _, db := range r.sqlDBs {
		err = errors.Join(err, db.Close())
	}
	return err
}

// Snapshot returns the tracker's current state. It is shared and
// immutable: do not modify it.
func (r *Router) Snapshot() *replay.Snapshot { return r.snapshot() }

// Tracker returns the router's tracker (its feed status, Watch), or nil
// for a router that was not started by NewRouter.
func (r *Router) Tracker() *replay.Tracker {
	t, _ := r.tr.(*replay.Tracker)
	return t
}

// Config returns the router's configuration with defaults applied. The
// Databases map is a copy; the pools in it are the application's.
func (r *Router) Config() Config {
	c := r.cfg
	c.Databases = maps.Clone(c.Databases)
	return c
}

// Route decides where job runs, once: the one decision, counted once.
//
// On success the returned context carries the pool per database (DB), the
// decision (DecisionFrom) and, for jobs the handler enqueues, the token
// merged with the positions of the replicas chosen (enqueue.TokenFrom;
// merged when first asked for, see enqueue.WithTokenSource). Those
// positions are what the replicas had replayed when chosen: a lower bound
// of what the handler's reads will see. Children that must see everything
// the handler read, including rows replayed in between, need enqueue's
// AfterReplicaRead on the read's connection.
//
// A Delayed job may wait up to Config.WaitBudget inside Route, before the
// handler takes any snapshot; ctx's deadline shortens that budget. A job
// the cap refuses and that may be neither deferred nor refused
// (Job.Hold) waits inside Route until a replica serves it or the cap
// admits it. Otherwise Route returns a *DeferError (ErrDeferred,
// ErrCapped), or ctx's error if ctx ends during a wait. It never hands out
// a replica that is not known to have replayed the token. The Router
// keeps nothing of job.Token once it returns (the decision holds copies of
// its entries), so its entries may be a buffer the caller reuses, as a
// position.HeaderDecoder's are.
func (r *Router) Route(ctx context.Context, job Job) (context.Context, Decision, error) {
	return r.route(ctx, &job, nil)
}

// route decides, waits, verifies (with job.Verify), applies the cap,
// holds (job.Hold) and records the job (in t, when routed through a
// Tally).
func (r *Router) route(ctx context.Context, job *Job, t *Tally) (hctx context.Context, d Decision, err error) {
	// The span's context is for the waits and the cap's Redis calls, whose
	// spans are its children; the handler's context derives from ctx, so
	// the handler's spans are the route span's siblings, not children of a
	// span that has ended. A job outside any trace gets no span: caughtup's
	// spans join the application's traces, they never start one.
	if t.untraced(ctx) {
		// No trace to join (tracing.Start).
		if t == nil {
			return r.routeIn(ctx, ctx, job, nil, false)
		}
		if rc, ok := t.repeat(ctx, job); ok {
			t.count(&rc.d)
			r.logDecision(ctx, &rc.d, nil, job.Source)
			return rc, rc.d, nil
		}
		return r.routeIn(ctx, ctx, job, t, true)
	}
	sctx, span := r.tracer.Start(ctx, SpanRoute)
	hctx, d, err = r.routeIn(ctx, sctx, job, t, false)
	endRoute(span, job, &d, err)
	return hctx, d, err
}

// routeIn is route's work, in the route span's context sctx. With
// repeatable, t may offer the decision to the jobs that follow
// (Tally.repeat).
func (r *Router) routeIn(ctx, sctx context.Context, job *Job, t *Tally, repeatable bool) (context.Context, Decision, error) {
	tok, tokErr, verify := job.Token, job.TokenErr, job.Verify
	if tokErr != nil {
		tok = position.Token{}
	}
	rc, buf := newRouted(len(tok.Entries), t)
	now := r.cfg.Now() // one clock read for the decision and the exclusions
	in := DecideInput{
		Policy:   job.Policy,
		Token:    tok,
		TokenErr: tokErr,
		Snapshot: r.snapshotAt(now),
		Now:      now,
		Config:   &r.cfg,
		NoWait:   r.cfg.WaitBudget < 0,
		NoDefer:  job.NoDefer,
		DeferBy:  job.DeferBy,
		Spread:   r.spreadFor(t),
		Buf:      buf,
	}
	// The decision is made in the handler's context's allocation.
	d := &rc.d
	decide(&in, d)
	if r.probeBehind(sctx, d) {
		in.Snapshot = r.snapshotAt(now)
		decide(&in, d)
	}
	waited := false
	var verifyErr error
	if verify != nil {
		var err error
		if *d, waited, verifyErr, err = r.verified(sctx, &in, *d, verify); err != nil {
			return ctx, *d, err
		}
	}
	if d.Action == ActionWait {
		waited = true
		var err error
		ws := r.startWait(sctx, waitForReplica)
		*d, err = r.wait(sctx, &in, *d)
		endWait(ws, d, err)
		if err != nil {
			r.log.DebugContext(sctx, "caughtup: wait for a replica abandoned", slog.Any("error", err),
				slog.String(attrPolicy, d.Policy.String()), slog.Duration("waited", d.Waited))
			return ctx, *d, err
		}
	}
	r.chargeFallback(sctx, &in, d)
	if d.Action == ActionRefuse && job.Hold {
		waited = true
		var err error
		ws := r.startWait(sctx, waitForCap)
		*d, err = r.hold(sctx, &in, *d)
		endWait(ws, d, err)
		if err != nil {
			r.log.DebugContext(sctx, "caughtup: hold for a replica or the fallback cap abandoned", slog.Any("error", err),
				slog.String(attrPolicy, d.Policy.String()), slog.Duration("waited", d.Waited))
			return ctx, *d, err
		}
	}
	if tokErr == nil && d.Reason == ReasonUnverified {
		tokErr = verifyErr // for the warning
	}
	if t != nil && !waited {
		t.count(d)
	} else {
		r.met.recordTo(ctx, d, waited, t)
	}
	r.logDecision(sctx, d, tokErr, job.Source)
	switch d.Action {
	case ActionDefer, ActionRefuse:
		return ctx, *d, &DeferError{Delay: d.Delay, Decision: *d}
	}
	// With a Verifier, the token's positions are not commit-safe by
	// themselves (the Verifier vouched for them): children inherit only
	// what the replicas read had replayed.
	rc.src, rc.captured, rc.now = &r.direct, tok.CapturedAt, in.Now
	if t != nil {
		rc.src = &t.src
	}
	hctx := handlerContext(ctx, rc, verify != nil)
	if repeatable && !waited && verify == nil && tokErr == nil {
		t.remember(in.Snapshot, rc, ctx)
	}
	return hctx, *d, nil
}
