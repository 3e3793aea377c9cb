package caughtupasynq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/internal/tracing"
	"github.com/caughtup/caughtup/position"
)

// ErrInvalidConfig is wrapped by the errors of MiddlewareConfig.Validate
// and NewServer.
var ErrInvalidConfig = errors.New("caughtup/asynq: invalid config")

// MiddlewareConfig configures Middleware and NewServer. The zero value
// routes every task with the router's default policy.
type MiddlewareConfig struct {
	// Policies sets the policy per task type, as GitLab sets a worker's
	// data consistency where the worker is declared. Keys are matched the
	// way asynq.ServeMux matches patterns: the exact type first, else the
	// longest key that is a prefix of the type ("email:" covers
	// "email:welcome"). An empty key, or a value that is not a
	// consume.Policy, is refused.
	// Default: none, every type gets DefaultPolicy.
	Policies map[string]consume.Policy

	// DefaultPolicy applies to task types Policies does not match.
	// Default: consume.PolicyDefault, the router's Config.DefaultPolicy
	// (Delayed unless configured otherwise).
	// One setting then governs every adapter in the process.
	DefaultPolicy consume.Policy

	// Redis is the Redis the server's tasks are in: the middleware opens
	// its Inspector there (asynq.NewInspector) unless Inspector is set,
	// and a client there that moves caught-up tasks to pending many per
	// round trip; both live as long as the process. Middleware needs
	// Redis or Inspector, or WakeCapacity -1: without an Inspector
	// deferred tasks would silently wait out their whole delay. With an
	// Inspector alone, each woken task costs its own lookup and move.
	// NewServer sets it to the server's.
	// Default: nil.
	Redis asynq.RedisConnOpt

	// Inspector, on the Redis the server's tasks are in, does two things.
	// It wakes deferred tasks: a task the middleware deferred is moved to
	// pending (Inspector.RunTask) as soon as a replica has replayed its
	// token, rather than when its deferral delay ends (see WakeCapacity).
	// And it lets the middleware look a task up when its context's
	// deadline is too near for a deferral, to learn whether that deadline
	// is the task's asynq.Deadline (absolute: deferring past it would
	// archive the task) or its asynq.Timeout (per attempt: deferring is
	// safe). Without one (and without Redis), deferred tasks run when
	// their delay ends, and the middleware reads HeaderDeadline, which
	// Client writes, assuming the deadline is absolute for tasks without
	// it (deadline_unknown). NewServer sets one on its Redis connection;
	// with ServerConfig and Middleware, set Redis (or pass an Inspector
	// here, which the middleware does not close).
	// Default: nil (the middleware opens one on Redis).
	Inspector *asynq.Inspector

	// WakeCapacity bounds how many deferred tasks the middleware
	// remembers to wake (with an Inspector). A remembered task is
	// forgotten when it comes back to this process, is woken, or its
	// delay has ended. When the set is full the oldest task is forgotten
	// (caughtup.asynq.wake.dropped, evicted): it runs when its delay ends,
	// as every deferred task does if the process dies. Negative disables
	// waking. The wake runs one goroutine while tasks are remembered:
	// NewServer's Shutdown ends it; under Middleware alone it ends when
	// the last remembered task is woken, comes back or has reached its
	// delay.
	// Default: DefaultWakeCapacity (10,000).
	// More tasks than a worker process defers in a long replica outage at
	// hundreds of tasks per second, in a few MB (docs/measurements.md).
	WakeCapacity int

	// MeterProvider records caughtup.asynq.overrides and
	// caughtup.asynq.hooks.missing.
	// Default: otel.GetMeterProvider().
	// As the OpenTelemetry contrib instrumentations do.
	MeterProvider metric.MeterProvider

	// TracerProvider makes the caughtup.defer span of each deferral and the
	// caughtup.wake span of each batch of woken tasks, linked to their
	// deferrals'. The routing spans are the router's
	// (consume.Config.TracerProvider).
	// Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider

	// Propagators read the producer's trace context from the task's
	// headers, where NewTask wrote it, so that the task's spans (the
	// router's, the handler's) continue the trace of the request that
	// enqueued it. A context that already has a span (the application's
	// own instrumentation of its handlers) keeps it as their parent.
	// Default: otel.GetTextMapPropagator(), which propagates nothing until
	// the application sets one (otel.SetTextMapPropagator).
	Propagators propagation.TextMapPropagator

	// Logger reports, sampled, overrides that put load on the primary, and
	// missing server hooks as errors.
	// Default: slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns c with the globals in place of nil MeterProvider,
// TracerProvider, Propagators and Logger, and DefaultWakeCapacity for a zero WakeCapacity. Middleware
// and NewServer call it.
func (c MiddlewareConfig) WithDefaults() MiddlewareConfig {
	if c.WakeCapacity == 0 {
		c.WakeCapacity = DefaultWakeCapacity
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.Propagators == nil {
		c.Propagators = otel.GetTextMapPropagator()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports policies that name no consume.Policy, and a config
// that could not wake deferred tasks (no Redis, no Inspector, WakeCapacity
// not negative). Its errors wrap ErrInvalidConfig.
func (c MiddlewareConfig) Validate() error {
	if c.Redis == nil && c.Inspector == nil && c.WakeCapacity >= 0 {
		return fmt.Errorf("%w: Middleware needs MiddlewareConfig.Redis (the RedisConnOpt the server's tasks are in) or an Inspector to run deferred tasks as soon as a replica catches up; without one they wait out their whole delay. Set WakeCapacity: -1 to choose that", ErrInvalidConfig)
	}
	if c.DefaultPolicy > consume.Delayed {
		return fmt.Errorf("%w: DefaultPolicy %d is not a consume.Policy: use consume.Always, Sticky, Delayed or PolicyDefault", ErrInvalidConfig, c.DefaultPolicy)
	}
	for k, p := range c.Policies {
		if p > consume.Delayed {
			return fmt.Errorf("%w: Policies[%q] = %d is not a consume.Policy: use consume.Always, Sticky, Delayed or PolicyDefault", ErrInvalidConfig, k, p)
		}
		if strings.TrimSpace(k) == "" {
			return fmt.Errorf("%w: Policies has an empty task type: key policies by task type or type prefix (\"email:\")", ErrInvalidConfig)
		}
	}
	return nil
}

// Middleware returns the asynq middleware that routes each task before its
// handler runs. NewServer wires it with the server hooks it needs; use
// Middleware directly only together with ServerConfig, and give it the
// server's Redis so that it can wake deferred tasks:
//
//	func wire(redisOpt asynq.RedisConnOpt, router *consume.Router, mux *asynq.ServeMux) *asynq.Server {
//		srv := asynq.NewServer(redisOpt, caughtupasynq.ServerConfig(asynq.Config{Concurrency: 20}))
//		mux.Use(caughtupasynq.Middleware(router, caughtupasynq.MiddlewareConfig{
//			Redis:    redisOpt,
//			Policies: map[string]consume.Policy{"email:": consume.Delayed, "report:": consume.Sticky},
//		}))
//		return srv
//	}
//
// For each task it decodes the token header (position.DecodeHeaders) and
// asks the router where the task reads, with the policy of its type. The
// router may wait for a replica (Delayed, up to its WaitBudget). The
// handler then runs with the chosen pools in its context:
// consume.DB(ctx, "main"). A task without a usable header reads the
// primary and is counted by the router (outcome primary_no_token); a
// header that does not decode is reported under the source "asynq
// <type>" (consume.Job.Source). A bad header never fails a task. Each
// attempt of a task is routed once, and counted once.
//
// When no replica has caught up within the wait, a Delayed task is
// deferred: the middleware returns the router's *consume.DeferError
// without running the handler, and ServerConfig's hooks make asynq run it
// again after the router's delay without counting an attempt. With an
// Inspector (MiddlewareConfig.Inspector; NewServer has one) the
// middleware also remembers the task and moves it to pending as soon as
// the tracker sees a replica past its token, typically milliseconds after
// the catch-up instead of at the end of a delay of seconds; the delay
// stays as the safety net (see MiddlewareConfig.WakeCapacity). The router
// bounds deferral by the token's age (consume.Config.MaxAge); after that
// the task reads the primary, or is refused by the fallback cap, which
// does count as a failed attempt. Without ServerConfig's hooks every
// deferral costs a retry: when a task the middleware deferred comes back
// having been judged without them, it logs an error and counts
// caughtup.asynq.hooks.missing.
//
// # Last attempts and deadlines
//
// asynq archives a task whose attempt fails once its retry count has
// reached MaxRetry (always, for asynq.MaxRetry(0)), whatever the error, and
// fails every attempt of a task past its asynq.Deadline. Such a task is
// routed with limits (consume.Job.NoDefer or DeferBy, and Hold): it is
// never deferred on its last attempt, nor past its absolute deadline, but
// runs on a caught-up replica or else reads the primary, charged to the
// fallback cap and the fleet budget like any promotion
// (consume.ReasonCannotDefer). When the cap is spent, the task is held in
// its worker until a replica serves it or the cap admits it: the cap is
// never exceeded and the task is not archived for it. The limits applied
// are counted in caughtup.asynq.overrides (last_attempt, deadline,
// deadline_unknown).
//
// Only an absolute deadline limits deferral: asynq.Deadline, or the
// context's deadline when the handler is not run by asynq's server.
// asynq.Timeout gives every attempt a fresh deadline (now + Timeout), so a
// Timeout-only task defers like any other. asynq hands the handler only
// min(Deadline, now + Timeout), so when that is nearer than the deferral's
// delay plus two seconds the middleware finds out which it is: from Redis
// when it has an Inspector (NewServer), else from HeaderDeadline (Client
// writes it), else it assumes the deadline is absolute
// (deadline_unknown): the task runs now, on a caught-up replica or the
// primary, rather than risk being archived.
//
// # Deduplicated tasks
//
// A task enqueued with asynq.Unique or asynq.TaskID may stand for enqueues
// that asynq rejected as duplicates, whose writes its token does not
// cover: HeaderDedup "1", or a token without HeaderDedup (a plain
// *asynq.Client or an asynq.Scheduler enqueued it, and its options are
// unknown). Such a task is routed
// against its token merged with the primary's current position, read at
// the start of each attempt: it sees every write committed before it
// started, as it would on the primary. That costs one round trip to each
// configured primary per attempt; if it fails the task reads the primary
// (dedup_capture_failed). As with asynq alone, a duplicate rejected while
// the task is already running is not seen by that run.
//
// Wrapping the whole mux rather than calling mux.Use saves the small
// allocation asynq.ServeMux makes per task and middleware:
// srv.Start(caughtupasynq.Middleware(router, cfg)(mux)). Use one or the
// other: each copy routes the task (and may wait) again.
//
// Middleware panics if router is nil or cfg is invalid (see Validate):
// both are fixed at startup. NewServer returns those errors instead.
func Middleware(router *consume.Router, cfg MiddlewareConfig) asynq.MiddlewareFunc {
	m, err := newMiddleware(router, cfg, true)
	if err != nil {
		panic(err)
	}
	return m.wrap
}

type middleware struct {
	router    *consume.Router
	policies  policies
	primaries []primary
	inspector *asynq.Inspector
	met       *metrics
	tracer    trace.Tracer
	prop      propagation.TextMapPropagator
	log       *slog.Logger
	// hooks judges, for tasks it deferred, whether ServerConfig's hooks
	// saw the deferral; nil under NewServer, which installs them itself.
	hooks *hookWatch
	// waker runs deferred tasks once a replica has caught up; nil without
	// an Inspector or with WakeCapacity < 0.
	waker *waker
	// rdb is the client on MiddlewareConfig.Redis the waker moves tasks
	// with; nil without Redis. Server.Shutdown closes it.
	rdb redis.UniversalClient

	// deferMax is the router's longest deferral (consume.Config.DeferMax):
	// a deadline further than it plus deadlineSlack cannot be missed.
	// deferInitial is its first (consume.Config.DeferInitial).
	deferMax, deferInitial time.Duration

	warnDedup, warnDeadline *rate.Sometimes
}

func newMiddleware(router *consume.Router, cfg MiddlewareConfig, checkHooks bool) (*middleware, error) {
	if router == nil {
		return nil, fmt.Errorf("%w: a nil *consume.Router: build one with consume.NewRouter", ErrInvalidConfig)
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Inspector == nil && cfg.Redis != nil {
		cfg.Inspector = asynq.NewInspector(cfg.Redis)
	}
	rc := router.Config()
	sometimes := func() *rate.Sometimes { return &rate.Sometimes{First: 1, Interval: 10 * time.Second} }
	m := &middleware{
		router:       router,
		policies:     newPolicies(cfg.Policies, cfg.DefaultPolicy),
		inspector:    cfg.Inspector,
		tracer:       cfg.TracerProvider.Tracer(ScopeName),
		prop:         cfg.Propagators,
		log:          cfg.Logger,
		deferMax:     rc.DeferMax,
		deferInitial: rc.DeferInitial,
		warnDedup:    sometimes(),
		warnDeadline: sometimes(),
	}
	for _, name := range slices.Sorted(maps.Keys(rc.Databases)) {
		m.primaries = append(m.primaries, primary{
			pool: rc.Databases[name].Primary,
			cap:  enqueue.NewCapturer(enqueue.Config{Database: name, Now: rc.Now}),
		})
	}
	var err error
	if m.met, err = newMetrics(cfg.MeterProvider); err != nil {
		return nil, err
	}
	if checkHooks {
		m.hooks = newHookWatch(m.met, m.log)
	}
	if cfg.Inspector != nil && cfg.WakeCapacity > 0 {
		// asynq builds its clients on go-redis v9, the module caughtup uses;
		// an option that makes another kind of client keeps the per-task
		// path.
		if cfg.Redis != nil {
			if c, ok := cfg.Redis.MakeRedisClient().(redis.UniversalClient); ok {
				m.rdb = c
			}
		}
		if m.waker, err = newWaker(router, cfg.Inspector, m.rdb, cfg.WakeCapacity, cfg.MeterProvider, m.tracer, m.log); err != nil {
			if m.rdb != nil {
				_ = m.rdb.Close()
			}
			return nil, err
		}
	}
	return m, nil
}

// policies looks a task type's policy up as asynq.ServeMux looks up
// handlers.
type policies struct {
	exact    map[string]consume.Policy
	prefixes []prefixPolicy // longest first
	def      consume.Policy
}

type prefixPolicy struct {
	prefix string
	policy consume.Policy
}

func newPolicies(m map[string]consume.Policy, def consume.Policy) policies {
	p := policies{exact: maps.Clone(m), def: def}
	for k, v := range m {
		p.prefixes = append(p.prefixes, prefixPolicy{k, v})
	}
	sort.Slice(p.prefixes, func(i, j int) bool {
		a, b := p.prefixes[i].prefix, p.prefixes[j].prefix
		return len(a) > len(b) || (len(a) == len(b) && a < b)
	})
	return p
}

// lookup returns the policy configured for a task type.
func (p *policies) lookup(typename string) consume.Policy {
	if v, ok := p.exact[typename]; ok {
		return v
	}
	for _, pp := range p.prefixes {
		if strings.HasPrefix(typename, pp.prefix) {
			return pp.policy
		}
	}
	return p.def
}

type primary struct {
	pool *pgxpool.Pool
	cap  *enqueue.Capturer
}

func (m *middleware) wrap(next asynq.Handler) asynq.Handler {
	return &handler{m: m, next: next}
}

type handler struct {
	m    *middleware
	next asynq.Handler
}

var _ asynq.Handler = (*handler)(nil)

func (h *handler) ProcessTask(ctx context.Context, task *asynq.Task) error {
	return h.m.process(ctx, task, h.next)
}

// deadlineSlack is added to a deferral's delay before comparing it with
// the task's deadline: asynq rounds the retry time to whole seconds and
// moves due tasks every DelayedTaskCheckInterval (1s with ServerConfig).
const deadlineSlack = 2 * time.Second

// lastAttempt reports whether asynq archives the task if this attempt
// returns any error (processor.handleFailedMessage: Retried >= Retry).
func lastAttempt(ctx context.Context) bool {
	retried, ok1 := asynq.GetRetryCount(ctx)
	limit, ok2 := asynq.GetMaxRetry(ctx)
	return ok1 && ok2 && retried >= limit
}

func (m *middleware) process(ctx context.Context, task *asynq.Task, next asynq.Handler) error {
	if m.hooks != nil {
		m.hooks.arrived(ctx)
	}
	if m.waker != nil {
		m.waker.forget(ctx)
	}
	h := task.Headers()
	ctx = tracing.Continue(ctx, m.prop, propagation.MapCarrier(h))
	tok, decErr := position.DecodeHeaders(h[position.HeaderName])
	job := consume.Job{Token: tok, TokenErr: decErr, Policy: m.policies.lookup(task.Type())}
	if decErr != nil {
		job.Source = "asynq " + task.Type()
	}
	if decErr == nil && mayBeDeduplicated(h) && job.Policy != consume.Always {
		var err error
		if job.Token, err = m.dedupToken(ctx, tok); err != nil {
			// The primary has every write; that is what the dedup
			// position stands for.
			m.met.override(ctx, overrideDedupCapture)
			m.warnDedup.Do(func() {
				m.log.LogAttrs(ctx, slog.LevelWarn, "caughtup: could not read the primary's position for a deduplicated task; it reads the primary",
					slog.String("messaging.system", "asynq"), slog.String("caughtup.asynq.task_type", task.Type()), slog.Any("error", err))
			})
			job.Policy = consume.Always
		}
	}
	// A failure on the last attempt archives the task, deferral or not,
	// and a deferral past its absolute deadline fails its next attempt:
	// such a task is neither deferred nor refused. It runs on a caught-up
	// replica, or on the primary under the fallback cap, held in process
	// while the cap is spent.
	why := overrideNone
	if lastAttempt(ctx) {
		why = overrideLastAttempt
		job.NoDefer, job.Hold = true, true
	} else if by, v := m.deferBy(ctx, task); v != deadlineFar {
		why = overrideDeadline
		if v == deadlineUnknown {
			why = overrideDeadlineUnknown
		}
		job.DeferBy, job.Hold = by, true
	}
	rctx, d, err := m.router.Route(ctx, job)
	if why != overrideNone && (d.Reason == consume.ReasonCannotDefer || d.Held) {
		m.met.override(ctx, why)
	}
	// A replica the router chose that fails the handler (unreachable, or
	// reaching only servers behind the task) is the router's failure, not
	// the task's: the task is routed again, elsewhere, without spending
	// an attempt, and deferred, still without one, if that keeps failing.
	for reroutes := 0; err == nil; reroutes++ {
		herr := next.ProcessTask(rctx, task)
		if herr == nil || !consume.ReplicaFailed(rctx) {
			return herr
		}
		if reroutes == consume.MaxReroutes {
			return m.deferred(ctx, task, &consume.DeferError{Delay: m.deferInitial, Decision: d}, job.Token)
		}
		rctx, d, err = m.router.Route(ctx, job)
	}
	var de *consume.DeferError
	if !errors.As(err, &de) || de.Refused() {
		// ctx ended during a wait, or the cap refused a task that can be
		// retried: a failed attempt, which asynq retries.
		return err
	}
	return m.deferred(ctx, task, de, job.Token)
}

// deferred returns the deferral of a task, marked so that ServerConfig's
// hooks can confirm they saw it, and remembers it to judge when the task
// comes back and to wake it once a replica has replayed tok.
func (m *middleware) deferred(ctx context.Context, task *asynq.Task, de *consume.DeferError, tok position.Token) error {
	// The span is the moment of the deferral (asynq schedules the retry
	// once the handler returns); the wake span links back to it, and the
	// task's next attempt continues the same trace from its headers.
	_, span := consume.StartDefer(ctx, m.tracer, de, func() []attribute.KeyValue { return taskAttributes(ctx, task) })
	if m.waker != nil {
		m.waker.remember(ctx, tok, de.Delay, span.SpanContext())
	}
	span.End()
	if m.hooks == nil {
		return de
	}
	d := &deferral{DeferError: de}
	m.hooks.deferred(ctx, d)
	return d
}

type deadlineVerdict uint8

const (
	deadlineFar     deadlineVerdict = iota // no absolute deadline within d
	deadlineNear                           // an absolute deadline within d
	deadlineUnknown                        // a deadline within d, absolute or not unknown
)

// deferBy returns when a deferral of the task must have ended, from its
// absolute deadline less deadlineSlack, if that deadline may come before
// any deferral the router could ask for ends (consume.Config.DeferMax plus
// the slack). The context's deadline is the nearest the task can have
// (asynq sets min(Deadline, now + Timeout)); only when it is that near
// does it matter which it is: the task's asynq.Deadline from Redis (with
// an Inspector), else HeaderDeadline (Client writes it), else unknown,
// which counts as absolute.
func (m *middleware) deferBy(ctx context.Context, task *asynq.Task) (time.Time, deadlineVerdict) {
	dl, ok := ctx.Deadline()
	horizon := m.deferMax + deadlineSlack
	if !ok || time.Until(dl) >= horizon {
		return time.Time{}, deadlineFar
	}
	near := func(abs time.Time, has bool) (time.Time, deadlineVerdict) {
		if has && time.Until(abs) < horizon {
			return abs.Add(-deadlineSlack), deadlineNear
		}
		return time.Time{}, deadlineFar
	}
	id, fromAsynq := asynq.GetTaskID(ctx)
	if !fromAsynq {
		return near(dl, true) // the caller's own deadline
	}
	if m.inspector != nil {
		queue, _ := asynq.GetQueueName(ctx)
		info, err := m.inspector.GetTaskInfo(queue, id)
		if err == nil {
			return near(info.Deadline, !info.Deadline.IsZero())
		}
		m.warnDeadline.Do(func() {
			m.log.LogAttrs(ctx, slog.LevelWarn, "caughtup: could not look a task up to read its asynq.Deadline; using its header",
				slog.String("messaging.system", "asynq"), slog.String("caughtup.asynq.task_type", task.Type()), slog.Any("error", err))
		})
	}
	if v, ok := task.Headers()[HeaderDeadline]; ok {
		if abs, has, ok := parseDeadline(v); ok {
			return near(abs, has)
		}
	}
	return dl.Add(-deadlineSlack), deadlineUnknown
}

// dedupToken returns tok merged with every configured primary's current
// position, keeping tok's capture time so that deferral stays bounded by
// the task's own age (a task without a token has an unknown age and is not
// deferred at all).
func (m *middleware) dedupToken(ctx context.Context, tok position.Token) (position.Token, error) {
	captured := tok.CapturedAt
	for _, p := range m.primaries {
		now, err := p.capture(ctx)
		if err != nil {
			return position.Token{}, err
		}
		tok = tok.Merge(now)
	}
	tok.CapturedAt = captured
	return tok, nil
}

func (p primary) capture(ctx context.Context) (position.Token, error) {
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return position.Token{}, err
	}
	defer conn.Release()
	return p.cap.Capture(ctx, conn.Conn())
}
