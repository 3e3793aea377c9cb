package asynq

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

	hasynq "github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// MiddlewareConfig configures Middleware. The zero value routes every task
// with the router's default policy.
type MiddlewareConfig struct {
	// Policies sets the policy per task type, as GitLab sets a worker's
	// data consistency where the worker is declared. Keys are matched the
	// way asynq.ServeMux matches patterns: the exact type first, else the
	// longest key that is a prefix of the type ("email:" covers
	// "email:welcome"). Default: none.
	Policies map[string]consume.Policy

	// DefaultPolicy applies to task types Policies does not match.
	// Default consume.PolicyDefault: the router's Config.DefaultPolicy
	// (Delayed unless configured otherwise).
	DefaultPolicy consume.Policy

	// MeterProvider records caughtup.asynq.overrides. Default
	// otel.GetMeterProvider().
	MeterProvider metric.MeterProvider

	// Logger warns, sampled, about overrides that put load on the
	// primary. Default slog.Default().
	Logger *slog.Logger
}

// Validate reports policies that name no consume.Policy.
func (c MiddlewareConfig) Validate() error {
	if c.DefaultPolicy > consume.Delayed {
		return fmt.Errorf("caughtup/asynq: DefaultPolicy %d is not a consume.Policy", c.DefaultPolicy)
	}
	for k, p := range c.Policies {
		if p > consume.Delayed {
			return fmt.Errorf("caughtup/asynq: Policies[%q] = %d is not a consume.Policy", k, p)
		}
		if strings.TrimSpace(k) == "" {
			return errors.New("caughtup/asynq: Policies has an empty task type")
		}
	}
	return nil
}

// Middleware returns the asynq middleware that routes each task before its
// handler runs:
//
//	mux.Use(caughtupasynq.Middleware(router, caughtupasynq.MiddlewareConfig{
//		Policies: map[string]consume.Policy{"email:": consume.Delayed, "report:": consume.Sticky},
//	}))
//
// For each task it reads the token header (position.HeaderName) and asks
// router.Route where the task reads, with the policy of its type. Route
// may wait for a replica (Delayed, up to the router's WaitBudget). The
// handler then runs with the chosen pools in its context:
// consume.DB(ctx, "main"). A task without a usable header reads the
// primary and is counted by the router (outcome primary_no_token); a bad
// header never fails a task.
//
// When no replica has caught up within the wait, a Delayed task is
// deferred: the middleware returns the router's *consume.DeferError
// without running the handler, and the hooks of ServerConfig make asynq
// run it again after the router's delay without counting an attempt. The
// router bounds deferral by the token's age (consume.Config.MaxAge); after
// that the task reads the primary, or is refused by the fallback cap,
// which does count as a failed attempt. Use ServerConfig on the server, or
// every deferral costs a retry.
//
// asynq archives a task whose attempt fails once its retry count has
// reached MaxRetry (always, for asynq.MaxRetry(0)), whatever the error, and
// a task deferred past its deadline (asynq.Deadline, or a Timeout shorter
// than the delay plus two seconds) fails its next attempt. In those cases
// the middleware never returns a deferral: a Delayed task that no replica
// served within the wait is routed again as Sticky, a caught-up replica or
// else the primary (OverrideLastAttempt, OverrideDeadline; the router has
// then counted one deferral that did not happen), and a task the fallback
// cap refuses reads the primary anyway (OverrideCapped), since losing the
// job is worse than exceeding the cap.
//
// A task carrying HeaderDedup (enqueued with asynq.Unique or asynq.TaskID
// through Client) may stand for enqueues that asynq rejected as
// duplicates, whose writes its token does not cover. Such a task is routed
// against its token merged with the primary's current position, read at
// the start of each attempt: it sees every write committed before it
// started, as it would on the primary. That costs one round trip to each
// configured primary per attempt; if it fails the task reads the primary
// (OverrideDedupCapture). As with asynq alone, a duplicate rejected while
// the task is already running is not seen by that run.
//
// Wrapping the whole mux rather than calling mux.Use saves the small
// allocation asynq.ServeMux makes per task and middleware:
// srv.Start(caughtupasynq.Middleware(router, cfg)(mux)). Use one or the
// other: each copy routes the task (and may wait) again.
//
// Middleware panics if router is nil or cfg is invalid (see Validate):
// both are fixed at startup.
func Middleware(router *consume.Router, cfg MiddlewareConfig) hasynq.MiddlewareFunc {
	m, err := newMiddleware(router, cfg)
	if err != nil {
		panic(err)
	}
	return m.wrap
}

type middleware struct {
	router    *consume.Router
	policies  policies
	primaries []primary
	met       *metrics
	log       *slog.Logger
	warnCap   sampler
	warnDedup sampler
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

func newMiddleware(router *consume.Router, cfg MiddlewareConfig) (*middleware, error) {
	if router == nil {
		return nil, errors.New("caughtup/asynq: Middleware with a nil router")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rc := router.Config()
	m := &middleware{
		router:   router,
		policies: newPolicies(cfg.Policies, cfg.DefaultPolicy),
		log:      cfg.Logger,
	}
	for _, name := range slices.Sorted(maps.Keys(rc.Databases)) {
		m.primaries = append(m.primaries, primary{
			pool: rc.Databases[name].Primary,
			cap:  enqueue.NewCapturer(enqueue.Config{Database: name, Now: rc.Now}),
		})
	}
	if m.log == nil {
		m.log = slog.Default()
	}
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	var err error
	if m.met, err = newMetrics(mp); err != nil {
		return nil, fmt.Errorf("caughtup/asynq: creating instruments: %w", err)
	}
	return m, nil
}

func (m *middleware) wrap(next hasynq.Handler) hasynq.Handler {
	return &handler{m: m, next: next}
}

type handler struct {
	m    *middleware
	next hasynq.Handler
}

var _ hasynq.Handler = (*handler)(nil)

func (h *handler) ProcessTask(ctx context.Context, task *hasynq.Task) error {
	return h.m.process(ctx, task, h.next)
}

// deadlineSlack is added to a deferral's delay before comparing it with
// the task's deadline: asynq rounds the retry time to whole seconds and
// moves due tasks every DelayedTaskCheckInterval (1s with ServerConfig).
const deadlineSlack = 2 * time.Second

// deadlineWithin reports whether ctx (asynq's, from the task's Timeout or
// Deadline) ends within d.
func deadlineWithin(ctx context.Context, d time.Duration) bool {
	dl, ok := ctx.Deadline()
	return ok && time.Until(dl) < d
}

// lastAttempt reports whether asynq archives the task if this attempt
// returns any error (processor.handleFailedMessage: Retried >= Retry).
func lastAttempt(ctx context.Context) bool {
	retried, ok1 := hasynq.GetRetryCount(ctx)
	limit, ok2 := hasynq.GetMaxRetry(ctx)
	return ok1 && ok2 && retried >= limit
}

func (m *middleware) process(ctx context.Context, task *hasynq.Task, next hasynq.Handler) error {
	h := task.Headers()
	r := routing{header: h[position.HeaderName]}
	policy := m.policies.lookup(task.Type())
	if h[HeaderDedup] != "" && policy != consume.Always {
		var err error
		if r.tok, r.decoded, err = m.dedupToken(ctx, r.header); err != nil {
			// The primary has every write; that is what the dedup
			// position stands for.
			m.met.add(ctx, OverrideDedupCapture)
			m.warnDedup.warn(ctx, m.log, "caughtup: could not read the primary's position for a deduplicated task; it reads the primary",
				slog.String("messaging.system", "asynq"), slog.String("caughtup.asynq.task_type", task.Type()), slog.Any("error", err))
			policy = consume.Always
		}
	}
	rctx, err := m.route(ctx, &r, policy)
	if err == nil {
		return next.ProcessTask(rctx, task)
	}
	var de *consume.DeferError
	if !errors.As(err, &de) {
		return err // ctx ended during the wait
	}
	// A failure on the last attempt archives the task, deferral or not;
	// a deferral past the task's deadline fails its next attempt.
	why := OverrideLastAttempt
	switch {
	case lastAttempt(ctx):
	case deadlineWithin(ctx, de.Delay+deadlineSlack):
		why = OverrideDeadline
	default:
		return de
	}
	if !de.Capped() {
		// Delayed, after its wait: a caught-up replica, else the primary.
		m.met.add(ctx, why)
		if rctx, err = m.route(ctx, &r, consume.Sticky); err == nil {
			return next.ProcessTask(rctx, task)
		}
		if !errors.As(err, &de) {
			return err
		}
	}
	// Refused by the fallback cap: losing the job is worse than exceeding
	// the cap.
	m.met.add(ctx, OverrideCapped)
	m.warnCap.warn(ctx, m.log, "caughtup: the fallback cap refused a task that cannot be retried in time; it reads the primary anyway",
		slog.String("messaging.system", "asynq"), slog.String("caughtup.asynq.task_type", task.Type()), slog.String(attrOverride, string(why)))
	if rctx, err = m.route(ctx, &r, consume.Always); err != nil {
		return err
	}
	return next.ProcessTask(rctx, task)
}

// routing is what a task is routed with: its header, or the token
// dedupToken made of it.
type routing struct {
	header  string
	tok     position.Token
	decoded bool
}

func (m *middleware) route(ctx context.Context, r *routing, policy consume.Policy) (context.Context, error) {
	var err error
	if r.decoded {
		ctx, _, err = m.router.RouteToken(ctx, r.tok, policy)
	} else {
		ctx, _, err = m.router.Route(ctx, r.header, policy)
	}
	return ctx, err
}

// dedupToken returns the task's token merged with every configured
// primary's current position, keeping the task's capture time so that
// deferral stays bounded by the task's own age (a task without a token
// has an unknown age and is not deferred at all). decoded is false when
// the header does not decode: Route then sends the task to the primary
// and counts it as malformed.
func (m *middleware) dedupToken(ctx context.Context, header string) (tok position.Token, decoded bool, err error) {
	if header != "" {
		if tok, err = position.Decode(header); err != nil {
			return position.Token{}, false, nil
		}
	}
	captured := tok.CapturedAt
	for _, p := range m.primaries {
		now, err := p.capture(ctx)
		if err != nil {
			return position.Token{}, false, err
		}
		tok = tok.Merge(now)
	}
	tok.CapturedAt = captured
	return tok, true, nil
}

func (p primary) capture(ctx context.Context) (position.Token, error) {
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return position.Token{}, err
	}
	defer conn.Release()
	return p.cap.Capture(ctx, conn.Conn())
}
