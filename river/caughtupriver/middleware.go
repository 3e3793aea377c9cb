package caughtupriver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// Middleware is River worker middleware that routes each job before its
// worker runs. Install it on the client:
//
//	func newClient(router *consume.Router, primary *pgxpool.Pool, workers *river.Workers) (*river.Client[pgx.Tx], error) {
//		mw, err := caughtupriver.NewMiddleware(router, caughtupriver.Config{
//			Policies: map[string]consume.Policy{"email_send": consume.Delayed},
//		})
//		if err != nil {
//			return nil, err
//		}
//		return river.NewClient(riverpgxv5.New(primary), &river.Config{
//			Queues:     map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 20}},
//			Workers:    workers,
//			Middleware: []rivertype.Middleware{mw},
//		})
//	}
//
// and in the worker take the pool from the context: consume.DB(ctx, "main").
//
// # The token
//
// A job inserted with Insert or InsertMany carries its producer's token in
// its metadata (MetadataKey); the job is routed against it and costs no
// query. Every other job (inserted with client.InsertTx in the business
// transaction, by a plain client, by River's periodic jobs) is routed
// against the primary's WAL position read after the job was fetched: River
// fetches only committed jobs, so that position covers the transaction
// that inserted the job and every one committed before it. One read serves
// every job of the process that was waiting when it started (see
// caughtup.river.position.reads), and the jobs its scan of River's table
// saw committed and waiting (visibleJobs: caughtup.river.token
// earlier_read); a job snoozed is routed, when it comes straight back, by
// the position it was snoozed with (snoozed). A unique job (InsertOpts.UniqueOpts)
// gets both merged: River skips a duplicate insert, and the surviving
// job's metadata does not cover the duplicate's writes. A deferred job's
// age, which bounds its deferral (consume.Config.MaxAge), counts from its
// JobRow.CreatedAt when it has no metadata token, so that snoozing does not
// restart it.
//
// Metadata that does not decode sends the job to the primary, counted by
// the router (consume.ReasonMalformedToken) and logged, rate-limited, under
// the source "river <kind>". A failed position read sends the waiting
// jobs to the primary too (caughtup.river.tokens fetch_failed, a sampled
// warning). Neither fails the job.
//
// # Deferral
//
// When no replica has caught up within the router's WaitBudget, a Delayed
// job is snoozed (river.JobSnooze) for the router's delay: River then puts
// the job back without counting an attempt (it restores JobRow.Attempt and
// records no error; only metadata "snoozes" grows), so deferral never
// spends MaxAttempts. The job is woken (made available again) as soon as
// a replica has replayed its token (Config.WakeCapacity); its snooze is
// the safety net. Deferral is bounded by the token's age: after
// consume.Config.MaxAge the job reads the primary, under the fallback cap.
// A job refused by the cap, or whose token is ahead of the router's
// primary, fails this attempt with the router's error, and River retries
// it; on its last attempt (Attempt >= MaxAttempts, when any error
// discards it) it is instead held in its worker until a replica serves it
// or the cap admits it (consume.Job.Hold, caughtup.river.overrides
// last_attempt).
type Middleware struct {
	river.MiddlewareDefaults

	router   *consume.Router
	policies map[string]consume.Policy
	def      consume.Policy
	fetch    *fetchPositions // nil with UnstampedReadPrimary
	waker    *waker          // nil with a negative WakeCapacity
	met      *metrics
	tracer   trace.Tracer
	log      *slog.Logger
	warn     *rate.Sometimes
	// deferInitial is the router's first deferral delay, a snooze's
	// after replica failures (consume.Config.DeferInitial).
	deferInitial time.Duration
}

var _ rivertype.WorkerMiddleware = (*Middleware)(nil)

// NewMiddleware returns the middleware for router. It returns an error
// wrapping ErrInvalidConfig for a nil router, an invalid cfg, or a
// Config.Database the router does not know.
func NewMiddleware(router *consume.Router, cfg Config) (*Middleware, error) {
	if router == nil {
		return nil, fmt.Errorf("%w: a nil *consume.Router: build one with consume.NewRouter", ErrInvalidConfig)
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	rc := router.Config()
	m := &Middleware{
		router:   router,
		policies: maps.Clone(cfg.Policies),
		def:      cfg.DefaultPolicy,
		tracer:   cfg.TracerProvider.Tracer(ScopeName),
		log:      cfg.Logger,
		warn:     &rate.Sometimes{First: 1, Interval: 10 * time.Second},

		deferInitial: rc.DeferInitial,
	}
	var err error
	if m.met, err = newMetrics(cfg.MeterProvider); err != nil {
		return nil, err
	}
	if cfg.WakeCapacity > 0 {
		if m.waker, err = newWaker(router, cfg.WakeCapacity, cfg.MeterProvider, m.tracer, cfg.Logger); err != nil {
			return nil, err
		}
	}
	if !cfg.UnstampedReadPrimary {
		db, ok := rc.Databases[cfg.Database]
		if !ok {
			return nil, fmt.Errorf("%w: Database %q is not one of the router's (%v): name the database River's jobs live in", ErrInvalidConfig, cfg.Database, slices.Sorted(maps.Keys(rc.Databases)))
		}
		m.fetch = &fetchPositions{
			pool:    db.Primary,
			capture: enqueue.NewCapturer(enqueue.Config{Database: cfg.Database, Now: rc.Now}),
			timeout: cfg.PositionTimeout,
			met:     m.met,
		}
	}
	// Resolved here so that Always, which reads the primary whatever the
	// token, skips the position read.
	if m.def == consume.PolicyDefault {
		m.def = rc.DefaultPolicy
	}
	for k, p := range m.policies {
		if p == consume.PolicyDefault {
			m.policies[k] = m.def
		}
	}
	return m, nil
}

func (m *Middleware) policy(kind string) consume.Policy {
	if p, ok := m.policies[kind]; ok {
		return p
	}
	return m.def
}

// Work routes job, then runs doInner with the routed context, or snoozes
// the job when no replica can serve it yet.
func (m *Middleware) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	if m.waker != nil {
		m.waker.forget(ctx, job)
	}
	rj := consume.Job{Policy: m.policy(job.Kind)}
	read := m.jobToken(ctx, job, &rj)
	// Any error on the last attempt discards the job: a refusal by the
	// fallback cap is then held in the worker instead. A snooze is free
	// on any attempt, so the job may still be deferred.
	last := job.MaxAttempts > 0 && job.Attempt >= job.MaxAttempts
	rj.Hold = last
	rctx, d, err := m.router.Route(ctx, rj)
	if last && d.Held {
		m.met.overrides.Add(ctx, 1, m.met.lastAttempt)
	}
	// A replica the router chose that fails the worker (unreachable, or
	// reaching only servers behind the job) is the router's failure, not
	// the job's: the job is routed again, elsewhere, without spending an
	// attempt, and snoozed (still free) if that keeps failing.
	for reroutes := 0; err == nil; reroutes++ {
		werr := doInner(rctx)
		if werr == nil || !consume.ReplicaFailed(rctx) {
			return werr
		}
		if reroutes == consume.MaxReroutes {
			// Not remembered for a wake, nor its position kept: the
			// replica failed, not lag, and the worker ran.
			m.met.overrides.Add(ctx, 1, m.met.replicaFailed)
			return river.JobSnooze(m.deferInitial)
		}
		rctx, d, err = m.router.Route(ctx, rj)
	}
	var de *consume.DeferError
	if !errors.As(err, &de) || de.Refused() {
		// ctx ended during a wait, or the job was refused (the cap, a
		// primary the router has not seen fail over): a failed attempt,
		// which River retries after its own backoff.
		return err
	}
	delay := max(de.Delay, 0)
	// The span is the moment of the snooze; a wake's span links to it.
	span := m.traceSnooze(ctx, job, de)
	if !read.IsZero() {
		keepSnoozed(ctx, job, read, delay)
	}
	if m.waker != nil {
		m.waker.remember(ctx, job, rj.Token, delay, span.SpanContext(), !read.IsZero())
	}
	span.End()
	return river.JobSnooze(delay)
}

// traceSnooze starts a snooze's consume.SpanDefer span; the caller ends
// it.
func (m *Middleware) traceSnooze(ctx context.Context, job *rivertype.JobRow, de *consume.DeferError) trace.Span {
	_, span := consume.StartDefer(ctx, m.tracer, de, func() []attribute.KeyValue {
		return []attribute.KeyValue{
			attribute.String("messaging.system", "river"),
			attribute.String("messaging.destination.name", job.Queue),
			attribute.String("messaging.message.id", strconv.FormatInt(job.ID, 10)),
			attribute.String("caughtup.river.kind", job.Kind),
			attribute.Int("caughtup.river.attempt", job.Attempt),
		}
	})
	return span
}

// jobToken fills rj's token from job's metadata or a position read for
// the job, and counts where it came from. It returns that position when
// it alone is the job's token (kept at a snooze, keepSnoozed), else zero.
func (m *Middleware) jobToken(ctx context.Context, job *rivertype.JobRow, rj *consume.Job) (read position.Token) {
	if rj.Policy == consume.Always {
		m.met.token(ctx, tokenPrimaryPolicy)
		return read
	}
	tok, ok, err := TokenOf(job)
	switch {
	case err != nil:
		rj.TokenErr, rj.Source = err, "river "+job.Kind
		m.met.token(ctx, tokenMalformed)
		return read
	case ok && job.UniqueKey == nil:
		rj.Token = tok
		m.met.token(ctx, tokenMetadata)
		return read
	case !ok && m.fetch == nil:
		m.met.token(ctx, tokenNone)
		return read
	case m.fetch == nil:
		// A unique job without the fetch position: its metadata may not
		// cover a skipped duplicate's writes, and the primary has them.
		rj.Policy = consume.Always
		m.met.token(ctx, tokenPrimaryPolicy)
		return read
	case !ok && job.UniqueKey == nil:
		if st, kept := snoozedToken(job); kept {
			rj.Token = st
			m.met.token(ctx, tokenSnoozed)
			return st
		}
		if v, client := m.fetch.visible.of(ctx); v != nil {
			vt, seen := v.lookup(job)
			if v.startAhead() {
				go m.fetch.readAhead(ctx, v, client)
			}
			if seen {
				rj.Token = withCapturedAt(vt, job.CreatedAt)
				m.met.token(ctx, tokenEarlierRead)
				return rj.Token
			}
		}
	}
	pos, perr := m.fetch.token(ctx)
	if perr != nil {
		// The primary has every write the position stands for.
		rj.Policy = consume.Always
		m.met.token(ctx, tokenFetchFailed)
		m.warn.Do(func() {
			m.log.LogAttrs(ctx, slog.LevelWarn, "caughtup: could not read the primary's position for a fetched River job; it reads the primary",
				slog.String("messaging.system", "river"), slog.String("caughtup.river.kind", job.Kind), slog.Any("error", perr))
		})
		return read
	}
	if ok {
		// A unique job: the metadata token merged with the position; the
		// job's age is the older of the two (Merge keeps the earlier).
		rj.Token = tok.Merge(withCapturedAt(pos, job.CreatedAt))
		m.met.token(ctx, tokenMetadataFetch)
		return read
	}
	rj.Token = withCapturedAt(pos, job.CreatedAt)
	m.met.token(ctx, tokenFetch)
	if job.UniqueKey != nil {
		return read // read anew at every fetch (snoozedToken)
	}
	return rj.Token
}

// withCapturedAt is tok dated at: a fetched job's age counts from its
// insert, not from the read, so that a job snoozed again and again still
// reaches consume.Config.MaxAge and then reads the primary.
func withCapturedAt(tok position.Token, at time.Time) position.Token {
	if !at.IsZero() && at.Before(tok.CapturedAt) {
		tok.CapturedAt = at
	}
	return tok
}
