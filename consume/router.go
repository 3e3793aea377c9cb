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
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/position"
)

// Router routes jobs: one per process, shared by every worker goroutine.
// It owns the tracker's goroutines and connections (one per node), not
// the application's pools.
type Router struct {
	cfg    Config
	tr     *tracker
	gate   *fallbackGate // the per-process cap and the fleet budget (budget.go)
	met    *metrics
	gauges metric.Registration // the tracker's state gauges, until Close
	log    *slog.Logger
	spread spreadCounter
	pools  map[string]*Database
	// sqlDBs serve SQLDB: one *sql.DB per pool, opened at start.
	sqlDBs map[*pgxpool.Pool]*sql.DB

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

// cacheLine is the size of a cache line on amd64 and most arm64 cores.
const cacheLine = 64

// NewRouter validates cfg, starts the tracker and waits until every node
// has been queried once (or ctx ends, or Config.StalenessBound passes:
// nodes that have not answered by then count as unknown, and jobs fall
// back to the primary until they do). ctx bounds only this start; the
// tracker runs until Close.
func NewRouter(ctx context.Context, cfg Config) (*Router, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	r := newRouter(cfg)
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	fail := func(err error) (*Router, error) {
		if r.tr != nil {
			r.tr.close()
		}
		r.closeSQL()
		return nil, err
	}
	met, err := newMetrics(mp, r.cfg.Databases)
	if err != nil {
		return fail(fmt.Errorf("caughtup/consume: creating instruments: %w", err))
	}
	r.met = met
	if r.gate, err = newFallbackGate(&r.cfg, r.log); err != nil {
		return fail(fmt.Errorf("caughtup/consume: creating instruments: %w", err))
	}
	if r.tr, err = newTracker(&r.cfg, r.log, met.queries); err != nil {
		return fail(err)
	}
	if r.gauges, err = met.gauges(r.tr); err != nil {
		return fail(fmt.Errorf("caughtup/consume: registering gauges: %w", err))
	}
	bound := time.NewTimer(cfg.StalenessBound)
	defer bound.Stop()
	select {
	case <-r.tr.initDone:
	case <-bound.C:
		r.log.Warn("caughtup: not every node answered the tracker in time; jobs read the primary until they do",
			slog.Duration("waited", cfg.StalenessBound))
	case <-ctx.Done():
		_ = r.Close()
		return nil, ctx.Err()
	}
	return r, nil
}

// newRouter is a Router for cfg (defaults applied) without its metrics
// and tracker.
func newRouter(cfg Config) *Router {
	// Copy what the tracker and DB read, so the caller's map and slices
	// may change afterwards.
	cfg.Databases = maps.Clone(cfg.Databases)
	pools := make(map[string]*Database, len(cfg.Databases))
	for name, db := range cfg.Databases {
		db.Replicas = slices.Clone(db.Replicas)
		cfg.Databases[name] = db
		pools[name] = &db
	}
	r := &Router{
		cfg:    cfg,
		log:    cfg.Logger,
		pools:  pools,
		sqlDBs: make(map[*pgxpool.Pool]*sql.DB),
	}
	for _, db := range pools {
		r.openSQL(db.Primary)
		for _, rep := range db.Replicas {
			r.openSQL(rep.Pool)
		}
	}
	if r.log == nil {
		r.log = slog.Default()
	}
	return r
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
		err = r.gauges.Unregister()
		r.tr.close()
		err = errors.Join(err, r.closeSQL())
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
func (r *Router) Snapshot() *Snapshot { return r.tr.snapshot() }

// Config returns the router's configuration with defaults applied. The
// Databases map is a copy; the pools in it are the application's.
func (r *Router) Config() Config {
	c := r.cfg
	c.Databases = maps.Clone(c.Databases)
	return c
}

// Route decides where a job runs. header is the token's text as carried
// in position.HeaderName ("" for none); a token that does not decode reads
// the primary (ReasonMalformedToken) and is counted. policy PolicyDefault
// means Config.DefaultPolicy.
//
// On success the returned context carries the pool per database (DB), the
// decision (DecisionFrom) and, for jobs the handler enqueues, the token
// merged with the positions of the replicas chosen (enqueue.TokenFrom;
// merged when first asked for, see enqueue.WithTokenSource).
// Those positions are what the replicas had replayed when chosen: a lower
// bound of what the handler's reads will see. Children that must see
// everything the handler read, including rows replayed in between, need
// enqueue's AfterReplicaRead on the read's connection. A
// Delayed job may wait up to Config.WaitBudget inside Route, before the
// handler takes any snapshot; ctx's deadline shortens that budget.
// Otherwise Route returns a *DeferError (ErrDeferred, ErrCapped), or ctx's
// error if ctx is canceled during the wait. It never hands out a replica
// that is not known to have replayed the token.
func (r *Router) Route(ctx context.Context, header string, policy Policy) (context.Context, Decision, error) {
	if header == "" {
		return r.route(ctx, position.Token{}, nil, policy, nil, nil)
	}
	tok, err := position.Decode(header)
	return r.route(ctx, tok, err, policy, nil, nil)
}

// RouteToken is Route for a token already decoded (CDC events carry their
// position directly).
func (r *Router) RouteToken(ctx context.Context, tok position.Token, policy Policy) (context.Context, Decision, error) {
	return r.route(ctx, tok, nil, policy, nil, nil)
}

// RouteDecoded is Route for a token decoded by the caller, typically with
// position.DecodeHeaders from a message's header values, together with the
// error of that decoding. A non-nil decodeErr routes the job to the
// primary as malformed (ReasonMalformedToken) whatever tok holds, and the
// warning names the error. The Router keeps nothing of tok once it
// returns (the decision holds copies of its entries), so tok's entries may
// be a buffer the caller reuses, as a position.HeaderDecoder's are.
func (r *Router) RouteDecoded(ctx context.Context, tok position.Token, decodeErr error, policy Policy) (context.Context, Decision, error) {
	if decodeErr != nil {
		tok = position.Token{}
	}
	return r.route(ctx, tok, decodeErr, policy, nil, nil)
}

// route decides, waits, verifies (with a Verifier: RouteVerified), applies
// the cap and records the job (in t, when routed through a Tally).
func (r *Router) route(ctx context.Context, tok position.Token, tokErr error, policy Policy, verify Verifier, t *Tally) (context.Context, Decision, error) {
	rc, buf := newRouted(len(tok.Entries), t)
	in := DecideInput{
		Policy:   policy,
		Token:    tok,
		TokenErr: tokErr,
		Snapshot: r.tr.snapshot(),
		Now:      r.cfg.Now(),
		Config:   &r.cfg,
		NoWait:   r.cfg.WaitBudget < 0,
		// One counter for every worker, so that the jobs in flight at any
		// moment alternate between the replicas: a counter per Tally, or a
		// random pick per job, saved an atomic shared between cores, but
		// with a point query per message throughput dropped.
		Spread: r.spread.Add(1),
		Buf:    buf,
	}
	// The decision is made in the handler's context's allocation.
	d := &rc.d
	decide(&in, d)
	waited := false
	var verifyErr error
	if verify != nil {
		var err error
		if *d, waited, verifyErr, err = r.verified(ctx, &in, *d, verify); err != nil {
			return ctx, *d, err
		}
	}
	if d.Action == ActionWait {
		waited = true
		var err error
		if *d, err = r.wait(ctx, &in, *d); err != nil {
			r.log.DebugContext(ctx, "caughtup: wait for a replica abandoned", slog.Any("error", err),
				slog.String(attrPolicy, d.Policy.String()), slog.Duration("waited", d.Waited))
			return ctx, *d, err
		}
	}
	if d.Action == ActionRun && d.Fallback && !r.gate.allow(ctx, d) {
		in.Capped = true
		w := d.Waited
		decide(&in, d)
		d.Waited = w
	}
	if tokErr == nil && d.Reason == ReasonUnverified {
		tokErr = verifyErr // for the warning
	}
	r.met.recordTo(ctx, d, waited, t)
	r.logDecision(ctx, d, tokErr)
	switch d.Action {
	case ActionDefer, ActionRefuse:
		return ctx, *d, &DeferError{Delay: d.Delay, Decision: *d}
	}
	// With a Verifier, the token's positions are not commit-safe by
	// themselves (the Verifier vouched for them): children inherit only
	// what the replicas read had replayed.
	rc.r, rc.captured, rc.now = r, tok.CapturedAt, in.Now
	return handlerContext(ctx, rc, verify != nil), *d, nil
}
