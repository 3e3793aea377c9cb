package caughtupasynq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/caughtup/caughtup/consume"
)

// DelayedTaskCheckInterval is what ServerConfig sets
// asynq.Config.DelayedTaskCheckInterval to when it is zero: how often
// asynq moves due scheduled and retry tasks, deferrals included, to
// pending. asynq's own default, 5s, would add up to 5s to every deferral
// (the router's first is 1s) and every retry, while a check per second
// costs one cheap Redis script per queue.
const DelayedTaskCheckInterval = time.Second

// TaskCheckInterval is what ServerConfig sets asynq.Config.TaskCheckInterval
// to when it is zero. An idle asynq server (all its queues empty) sleeps
// between half and one and a half of this interval before polling its
// queues again (it does not block on Redis), so a task that becomes
// pending on it, such as a deferred task the middleware wakes when its
// replica catches up, or a new task, waits that long for a worker:
// 10-30ms rather than asynq's default 0.5-1.5s, for 50 short Redis scripts
// a second per queue of an idle server (docs/measurements.md).
const TaskCheckInterval = 20 * time.Millisecond

// Server is an asynq server whose handler runs behind the middleware, with
// the hooks the middleware needs on its asynq.Config: the one-call wiring.
// Use it as an *asynq.Server:
//
//	func serve(redisOpt asynq.RedisConnOpt, router *consume.Router, mux *asynq.ServeMux) error {
//		srv, err := caughtupasynq.NewServer(redisOpt, asynq.Config{Concurrency: 20}, router,
//			caughtupasynq.MiddlewareConfig{Policies: map[string]consume.Policy{"email:": consume.Delayed}})
//		if err != nil {
//			return err
//		}
//		return srv.Run(mux)
//	}
type Server struct {
	srv       *asynq.Server
	mw        *middleware
	redis     asynq.RedisConnOpt
	inspector *asynq.Inspector // owned: closed by Shutdown; nil if the config brought one
	closeOnce sync.Once
}

// NewServer returns a server on redis whose handler is routed by router
// (Middleware with mcfg) and whose config carries the hooks that keep
// deferrals from costing retries (ServerConfig(cfg)). The two belong
// together: without the hooks every deferral burns a retry and comes back
// after asynq's retry backoff. Use ServerConfig and Middleware yourself
// only to arrange them differently.
//
// mcfg.Inspector defaults to an inspector on redis, so the middleware
// wakes deferred tasks as soon as a replica has replayed their token and
// can tell a task's asynq.Deadline from its Timeout whoever enqueued it;
// the Server closes it on Shutdown. NewServer returns an error wrapping
// ErrInvalidConfig for a nil router or an invalid mcfg; like
// asynq.NewServer, it panics on an unsupported RedisConnOpt.
func NewServer(redis asynq.RedisConnOpt, cfg asynq.Config, router *consume.Router, mcfg MiddlewareConfig) (*Server, error) {
	if redis == nil {
		return nil, fmt.Errorf("%w: NewServer needs the RedisConnOpt of the Redis the tasks are in", ErrInvalidConfig)
	}
	s := &Server{redis: redis}
	if mcfg.Redis == nil {
		mcfg.Redis = redis
	}
	if mcfg.Inspector == nil {
		s.inspector = asynq.NewInspector(redis)
		mcfg.Inspector = s.inspector
	}
	m, err := newMiddleware(router, mcfg, false)
	if err != nil {
		s.closeInspector()
		return nil, err
	}
	s.mw = m
	s.srv = asynq.NewServer(redis, serverConfig(cfg, m.met, m.log))
	return s, nil
}

// Start starts the server with handler (usually an *asynq.ServeMux) behind
// the middleware, as asynq.Server.Start. Do not also mux.Use the
// middleware: each copy routes (and may wait) again.
func (s *Server) Start(handler asynq.Handler) error {
	if handler == nil {
		return errors.New("caughtup/asynq: server cannot run with a nil handler")
	}
	return s.srv.Start(s.mw.wrap(handler))
}

// Run is Start, then waits for SIGTERM or SIGINT and shuts the server
// down, as asynq.Server.Run.
func (s *Server) Run(handler asynq.Handler) error {
	if handler == nil {
		return errors.New("caughtup/asynq: server cannot run with a nil handler")
	}
	err := s.srv.Run(s.mw.wrap(handler))
	if err == nil {
		s.closeInspector()
	}
	return err
}

// Shutdown shuts the server down gracefully, as asynq.Server.Shutdown,
// stops waking deferred tasks (they run when their delays end, whichever
// server is running then) and closes the inspector NewServer opened.
func (s *Server) Shutdown() {
	s.srv.Shutdown()
	s.closeInspector()
}

// Stop stops pulling new tasks, as asynq.Server.Stop; call Shutdown
// before exiting.
func (s *Server) Stop() { s.srv.Stop() }

// Ping pings the server's Redis, as asynq.Server.Ping.
func (s *Server) Ping() error { return s.srv.Ping() }

func (s *Server) closeInspector() {
	s.closeOnce.Do(func() {
		if s.mw != nil && s.mw.waker != nil {
			s.mw.waker.close()
		}
		if s.mw != nil && s.mw.rdb != nil {
			_ = s.mw.rdb.Close()
		}
		if s.inspector != nil {
			_ = s.inspector.Close()
		}
	})
}

// ServerConfig returns cfg with the hooks a server running Middleware
// needs. NewServer applies it; to wire the pieces yourself, pass the
// result to asynq.NewServer:
//
//	func newServer(redisOpt asynq.RedisConnOpt) *asynq.Server {
//		return asynq.NewServer(redisOpt, caughtupasynq.ServerConfig(asynq.Config{Concurrency: 20}))
//	}
//
// and do not replace its hooks afterwards: Middleware reports deferrals
// that come back without them (caughtup.asynq.hooks.missing).
//
//   - RetryDelayFunc: a deferral (*consume.DeferError, also wrapped) runs
//     again after the router's delay, rounded up to the whole second asynq
//     schedules in. Other errors get cfg.RetryDelayFunc (default
//     asynq.DefaultRetryDelayFunc), unchanged.
//   - IsFailure: a deferral is not a failure, so asynq does not count it
//     against the task's MaxRetry (the router bounds deferral by the
//     token's age instead). A refusal by the fallback cap
//     (consume.ErrCapped) is one, so a lasting refusal ends in the
//     middleware's last-attempt override rather than looping. Other
//     errors get cfg.IsFailure (default: every error).
//   - ErrorHandler: cfg's handler is not called for deferrals.
//   - GroupAggregator: the aggregated task carries the merged token of the
//     tasks it aggregates (none, so the primary, if any of them has none)
//     and HeaderDedup if any of them has it. Build it with NewTask (or
//     give it a headers map): see aggregator.
//   - DelayedTaskCheckInterval: DelayedTaskCheckInterval when zero.
//   - TaskCheckInterval: TaskCheckInterval when zero.
//
// The GroupAggregator hook logs to slog.Default() and counts on
// otel.GetMeterProvider(); NewServer's uses MiddlewareConfig's.
//
// asynq archives a task that fails on its last attempt whatever IsFailure
// says; Middleware never defers on a last attempt for that reason.
func ServerConfig(cfg asynq.Config) asynq.Config {
	met, err := newMetrics(otel.GetMeterProvider())
	if err != nil {
		met, _ = newMetrics(noop.NewMeterProvider())
	}
	return serverConfig(cfg, met, slog.Default())
}

func serverConfig(cfg asynq.Config, met *metrics, log *slog.Logger) asynq.Config {
	delay := cfg.RetryDelayFunc
	if delay == nil {
		delay = asynq.DefaultRetryDelayFunc
	}
	cfg.RetryDelayFunc = func(n int, err error, task *asynq.Task) time.Duration {
		var de *consume.DeferError
		if errors.As(err, &de) {
			seen(err, seenRetryDelay)
			return retryDelay(de.Delay, time.Now())
		}
		return delay(n, err, task)
	}
	isFailure := cfg.IsFailure
	cfg.IsFailure = func(err error) bool {
		var de *consume.DeferError
		if errors.As(err, &de) {
			seen(err, seenIsFailure)
			return de.Refused()
		}
		if isFailure == nil {
			return err != nil
		}
		return isFailure(err)
	}
	if eh := cfg.ErrorHandler; eh != nil {
		cfg.ErrorHandler = asynq.ErrorHandlerFunc(func(ctx context.Context, task *asynq.Task, err error) {
			if !isDeferral(err) {
				eh.HandleError(ctx, task, err)
			}
		})
	}
	if ga := cfg.GroupAggregator; ga != nil {
		cfg.GroupAggregator = newAggregator(ga, met, log)
	}
	if cfg.DelayedTaskCheckInterval == 0 {
		cfg.DelayedTaskCheckInterval = DelayedTaskCheckInterval
	}
	if cfg.TaskCheckInterval == 0 {
		cfg.TaskCheckInterval = TaskCheckInterval
	}
	return cfg
}

// isDeferral reports a deferral for lag (not a refusal by the cap).
func isDeferral(err error) bool {
	var de *consume.DeferError
	return errors.As(err, &de) && !de.Refused()
}

// retryDelay converts the router's delay into the one asynq needs:
// asynq stores the retry time as (now + delay).Unix(), dropping the
// fraction, so the delay is raised to reach the next whole second and the
// task is never due before d has passed.
func retryDelay(d time.Duration, now time.Time) time.Duration {
	at := now.Add(max(d, 0))
	sec := at.Unix()
	if at.Nanosecond() > 0 {
		sec++
	}
	return time.Unix(sec, 0).Sub(now)
}
