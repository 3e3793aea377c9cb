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
	"github.com/jackc/pgx/v5/stdlib"
	"go.opentelemetry.io/otel"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/enqueue"
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
	log    *slog.Logger
	spread atomic.Uint32
	pools  map[string]*Database
	// sqlDBs serve SQLDB: one *sql.DB per pool, opened at start.
	sqlDBs map[*pgxpool.Pool]*sql.DB

	warnMu sync.Mutex
	warns  map[Reason]*rate.Sometimes

	closeOnce sync.Once
}

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
		warns:  make(map[Reason]*rate.Sometimes),
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
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	var err error
	if r.gate, err = newFallbackGate(&r.cfg, r.log); err != nil {
		return nil, fmt.Errorf("caughtup/consume: creating instruments: %w", err)
	}
	tr, err := newTracker(&r.cfg, r.log)
	if err != nil {
		return nil, err
	}
	r.tr = tr
	if r.met, err = newMetrics(mp, tr); err != nil {
		tr.close()
		return nil, fmt.Errorf("caughtup/consume: creating instruments: %w", err)
	}
	bound := time.NewTimer(cfg.StalenessBound)
	defer bound.Stop()
	select {
	case <-tr.initDone:
	case <-bound.C:
		r.log.Warn("caughtup: not every node answered the tracker in time; jobs read the primary until they do",
			slog.Duration("waited", cfg.StalenessBound))
	case <-ctx.Done():
		_ = r.Close()
		return nil, ctx.Err()
	}
	return r, nil
}

// Close stops the tracker's goroutines and closes its connections. It
// does not close the application's pools. Routing after Close still works
// but, with the tracker stopped, every replica soon counts as stale. The
// tracker's gauges end; the decision counters stay with the
// MeterProvider, as a synchronous counter's sums do, so that a collection
// after Close (at MeterProvider.Shutdown) still reports every job.
func (r *Router) Close() error {
	var err error
	r.closeOnce.Do(func() {
		err = r.met.reg.Unregister()
		r.tr.close()
		for _, db := range r.sqlDBs {
			err = errors.Join(err, db.Close())
		}
	})
	return err
}

// openSQL opens the *sql.DB that SQLDB hands out for p. Opening one
// connects nothing: connections come from p as they are used.
func (r *Router) openSQL(p *pgxpool.Pool) {
	if _, ok := r.sqlDBs[p]; !ok {
		r.sqlDBs[p] = stdlib.OpenDBFromPool(p)
	}
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
	Delay    time.Duration
	Decision Decision
}

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
		return r.route(ctx, position.Token{}, nil, policy)
	}
	tok, err := position.Decode(header)
	return r.route(ctx, tok, err, policy)
}

// RouteToken is Route for a token already decoded (CDC events carry their
// position directly).
func (r *Router) RouteToken(ctx context.Context, tok position.Token, policy Policy) (context.Context, Decision, error) {
	return r.route(ctx, tok, nil, policy)
}

// RouteDecoded is Route for a token decoded by the caller, typically with
// position.DecodeHeaders from a message's header values, together with the
// error of that decoding. A non-nil decodeErr routes the job to the
// primary as malformed (ReasonMalformedToken) whatever tok holds, and the
// warning names the error.
func (r *Router) RouteDecoded(ctx context.Context, tok position.Token, decodeErr error, policy Policy) (context.Context, Decision, error) {
	if decodeErr != nil {
		tok = position.Token{}
	}
	return r.route(ctx, tok, decodeErr, policy)
}

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

func (r *Router) route(ctx context.Context, tok position.Token, tokErr error, policy Policy) (context.Context, Decision, error) {
	rc, buf := newRouted(len(tok.Entries))
	rc.r = r
	in := DecideInput{
		Policy:   policy,
		Token:    tok,
		TokenErr: tokErr,
		Snapshot: r.tr.snapshot(),
		Now:      r.cfg.Now(),
		Config:   &r.cfg,
		NoWait:   r.cfg.WaitBudget < 0,
		Spread:   r.spread.Add(1),
		Buf:      buf,
	}
	d := Decide(in)
	waited := false
	if d.Action == ActionWait {
		waited = true
		var err error
		if d, err = r.wait(ctx, &in, d); err != nil {
			r.log.DebugContext(ctx, "caughtup: wait for a replica abandoned", slog.Any("error", err),
				slog.String(attrPolicy, d.Policy.String()), slog.Duration("waited", d.Waited))
			return ctx, d, err
		}
	}
	if d.Action == ActionRun && d.Fallback && !r.gate.allow(ctx, &d) {
		in.Capped = true
		w := d.Waited
		d = Decide(in)
		d.Waited = w
	}
	r.met.record(ctx, &d, waited)
	r.logDecision(ctx, &d)
	switch d.Action {
	case ActionDefer, ActionRefuse:
		return ctx, d, &DeferError{Delay: d.Delay, Decision: d}
	}
	rc.Context, rc.d = ctx, d
	if tok.IsZero() {
		return rc, d, nil
	}
	rc.tok, rc.now = tok, in.Now
	return enqueue.WithTokenSource(rc, (*childSource)(rc)), d, nil
}

// wait re-decides on every snapshot the tracker publishes until Decide
// stops saying ActionWait or the budget runs out; meanwhile the replicas
// it waits on are polled every WaitPollInterval.
func (r *Router) wait(ctx context.Context, in *DecideInput, d Decision) (Decision, error) {
	start := time.Now()
	budget := r.cfg.WaitBudget
	if dl, ok := ctx.Deadline(); ok {
		budget = min(budget, time.Until(dl))
	}
	in.Waited = true
	if budget <= 0 {
		in.NoWait = true
		return Decide(*in), nil
	}
	defer r.watch(in.Snapshot, &d)()
	timer := time.NewTimer(budget)
	defer timer.Stop()
	for {
		snap := r.tr.snapshot()
		in.Snapshot, in.Now = snap, r.cfg.Now()
		d = Decide(*in)
		if d.Action != ActionWait {
			d.Waited = time.Since(start)
			return d, nil
		}
		select {
		case <-snap.changed:
			continue
		case <-timer.C:
		case <-ctx.Done():
			// A deadline only shortened the budget (it and the timer fire
			// together); a cancellation abandons the job.
			if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				d.Waited = time.Since(start)
				return d, ctx.Err()
			}
		}
		in.NoWait = true
		in.Snapshot, in.Now = r.tr.snapshot(), r.cfg.Now()
		d = Decide(*in)
		d.Waited = time.Since(start)
		return d, nil
	}
}

// watch speeds up polling of the replicas a waiting decision could be
// satisfied by: those of the databases still behind that answered their
// last query. Failing replicas keep the slow pace, so a wait never turns
// into a reconnect storm.
func (r *Router) watch(s *Snapshot, d *Decision) func() {
	var undo []func()
	for _, dd := range d.Databases {
		if dd.Outcome != outcomeWait {
			continue
		}
		for i := range s.Databases {
			ds := &s.Databases[i]
			if ds.Name != dd.Database {
				continue
			}
			var idx []int
			for j := range ds.Replicas {
				if ds.Replicas[j].Err == nil {
					idx = append(idx, j)
				}
			}
			undo = append(undo, r.tr.watch(i, idx))
		}
	}
	return func() {
		for _, u := range undo {
			u()
		}
	}
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

func (r *Router) logDecision(ctx context.Context, d *Decision) {
	warn := false
	switch d.Reason {
	case ReasonMalformedToken, ReasonEpoch, ReasonNoHealthyReplica, ReasonTrackerStale, ReasonUnknownDatabase, ReasonCapped:
		warn = true
	}
	level := slog.LevelDebug
	if warn {
		level = slog.LevelWarn
	}
	if !r.log.Enabled(ctx, level) {
		return
	}
	emit := func() {
		attrs := make([]slog.Attr, 0, 8+2*len(d.Databases))
		attrs = append(attrs,
			slog.String("db.system.name", "postgresql"),
			slog.String(attrPolicy, d.Policy.String()),
			slog.String(attrOutcome, d.Outcome.String()),
			slog.String(attrReason, d.Reason.String()),
			slog.Duration("caughtup.token_age", d.TokenAge),
		)
		if d.Waited > 0 {
			attrs = append(attrs, slog.Duration("caughtup.waited", d.Waited))
		}
		if d.Action == ActionDefer || d.Action == ActionRefuse {
			attrs = append(attrs, slog.Duration("caughtup.delay", d.Delay))
		}
		for _, dd := range d.Databases {
			g := []any{
				slog.String(attrOutcome, dd.Outcome.String()),
				slog.String(attrReason, dd.Reason.String()),
			}
			if dd.Replica != "" {
				g = append(g, slog.String(attrReplica, dd.Replica))
			}
			if dd.BytesBehind > 0 {
				g = append(g, slog.Uint64("caughtup.bytes_behind", dd.BytesBehind))
			}
			if dd.Reason == ReasonEpoch {
				g = append(g, slog.String("caughtup.incomparable", dd.Incomparable.String()))
			}
			attrs = append(attrs, slog.Group(attrDatabase+"."+dd.Database, g...))
		}
		r.log.LogAttrs(ctx, level, "caughtup: routed job", attrs...)
	}
	if !warn {
		emit()
		return
	}
	// Degraded state tends to hit every job at once; metrics count each,
	// the log samples.
	r.warnMu.Lock()
	s := r.warns[d.Reason]
	if s == nil {
		s = &rate.Sometimes{First: 3, Interval: 10 * time.Second}
		r.warns[d.Reason] = s
	}
	r.warnMu.Unlock()
	s.Do(emit)
}

// ErrNotRouted is returned by Pool and SQLDB for a context that did not
// come from Router.Route (or RouteToken, RouteDecoded): a handler that is
// not wrapped in an adapter's middleware, or a context made elsewhere.
var ErrNotRouted = errors.New("caughtup/consume: the context was not routed: wrap the handler in the adapter's middleware (caughtupasynq.Middleware, caughtupkafka.NewConsumer with a Router) or call Router.Route")

// ErrUnknownDatabase is returned by Pool and SQLDB for a database name
// that is not in the router's Config.Databases.
var ErrUnknownDatabase = errors.New("caughtup/consume: unknown database")

// Pool returns the pool a routed handler reads database from: the replica
// chosen for it, or the primary when the decision put it there or the
// token did not name it. ctx must come from Route; otherwise the error is
// ErrNotRouted. A database missing from Config.Databases returns an error
// wrapping ErrUnknownDatabase that names the configured ones.
func Pool(ctx context.Context, database string) (*pgxpool.Pool, error) {
	rc, _ := ctx.Value(routedKey{}).(*routed)
	if rc == nil {
		return nil, ErrNotRouted
	}
	db := rc.r.pools[database]
	if db == nil {
		return nil, rc.r.unknownDatabase(database)
	}
	for _, dd := range rc.d.Databases {
		if dd.Database == database && dd.replica >= 0 && int(dd.replica) < len(db.Replicas) {
			return db.Replicas[dd.replica].Pool, nil
		}
	}
	return db.Primary, nil
}

// DB is Pool for handlers that treat a missing pool as a programming
// error: it never returns nil, and panics with a message that names the
// database and the configured ones, or says that ctx was not routed.
// Handlers that would rather fail the job than the process call Pool.
func DB(ctx context.Context, database string) *pgxpool.Pool {
	p, err := Pool(ctx, database)
	if err != nil {
		panic(err)
	}
	return p
}

// SQLDB is Pool for code written against database/sql (GORM, sqlx, ent,
// bun, sqlc's database/sql mode): a *sql.DB over the same chosen pool,
// through pgx's stdlib. The router opens one per pool when it starts and
// closes them on Close; they never close the application's pools, and
// keep no idle connections of their own (the pgx pool holds them).
func SQLDB(ctx context.Context, database string) (*sql.DB, error) {
	p, err := Pool(ctx, database)
	if err != nil {
		return nil, err
	}
	rc := ctx.Value(routedKey{}).(*routed)
	return rc.r.sqlDBs[p], nil
}

func (r *Router) unknownDatabase(database string) error {
	names := slices.Sorted(maps.Keys(r.pools))
	return fmt.Errorf("%w %q: the router knows %q (consume.Config.Databases)", ErrUnknownDatabase, database, names)
}

// DecisionFrom returns the decision of a context that came from Route.
func DecisionFrom(ctx context.Context) (Decision, bool) {
	rc, _ := ctx.Value(routedKey{}).(*routed)
	if rc == nil {
		return Decision{}, false
	}
	return rc.d, true
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
