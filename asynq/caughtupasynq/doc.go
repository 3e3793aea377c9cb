// Package caughtupasynq is caughtup's adapter for github.com/hibiken/asynq: a
// client wrapper that stamps each task with the token of the writes before
// it, and a server that runs each task on a replica that has replayed them,
// letting a task wait for a replica without spending its retries.
//
// A producer and a worker, beside asynq itself:
//
//	import (
//		"context"
//
//		"github.com/hibiken/asynq"
//		"github.com/jackc/pgx/v5"
//		"github.com/jackc/pgx/v5/pgxpool"
//
//		"github.com/caughtup/caughtup/asynq/caughtupasynq"
//		"github.com/caughtup/caughtup/consume"
//		"github.com/caughtup/caughtup/enqueue"
//		"github.com/caughtup/caughtup/replay"
//	)
//
//	// Producer: commit, then build and enqueue the task with the context the
//	// commit returned. client is caughtupasynq.NewClient(asynq.NewClient(redisOpt)).
//	func signUp(ctx context.Context, pool *pgxpool.Pool, client *caughtupasynq.Client, email string) error {
//		ctx, err := enqueue.InTx(ctx, pool, func(tx pgx.Tx) error {
//			_, err := tx.Exec(ctx, "INSERT INTO users (email) VALUES ($1)", email)
//			return err
//		})
//		if err != nil {
//			return err // an *enqueue.CaptureError whose Committed is true: the row is there, the token is not
//		}
//		task := caughtupasynq.NewTask(ctx, "email:welcome", []byte(email), asynq.MaxRetry(5))
//		_, err = client.EnqueueContext(ctx, task, asynq.Queue("mail"))
//		return err
//	}
//
//	// Worker: one router per process, one server, and handlers that take their
//	// pool from the context.
//	func work(ctx context.Context, redisOpt asynq.RedisConnOpt, primary, r1, r2 *pgxpool.Pool) error {
//		router, err := consume.NewRouter(ctx, consume.Config{
//			Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(r1, r2)}},
//		})
//		if err != nil {
//			return err
//		}
//		defer router.Close()
//		srv, err := caughtupasynq.NewServer(redisOpt, asynq.Config{Concurrency: 20}, router, caughtupasynq.MiddlewareConfig{
//			Policies: map[string]consume.Policy{"email:": consume.Delayed, "billing:": consume.Always},
//		})
//		if err != nil {
//			return err
//		}
//		mux := asynq.NewServeMux()
//		mux.HandleFunc("email:welcome", func(ctx context.Context, t *asynq.Task) error {
//			var id int64 // read on a replica that has the sign-up, or on the primary
//			return consume.DB(ctx, "main").QueryRow(ctx, "SELECT id FROM users WHERE email = $1", string(t.Payload())).Scan(&id)
//		})
//		return srv.Run(mux)
//	}
//
// NewServer is asynq.NewServer with the two pieces that must go together:
// ServerConfig's hooks on the asynq.Config and Middleware around the
// handler. To arrange them yourself (a mux built elsewhere, your own
// middleware outside caughtup's), use both: Middleware reports, as an error
// log and caughtup.asynq.hooks.missing, a deferred task that comes back
// without the hooks. Give that Middleware the server's Redis
// (MiddlewareConfig.Redis: redisOpt), so that it wakes deferred tasks
// (below). Without it, an Inspector or WakeCapacity -1, Middleware panics
// with the error MiddlewareConfig.Validate returns (call Validate first to
// handle it as an error); NewServer returns that error instead.
//
// # Options: build tasks with NewTask
//
// asynq v0.26 cannot read a task's options back, and headers can only be
// set when a task is built, so stamping means building a new task with the
// same options. NewTask and NewTaskWithHeaders take asynq's arguments plus
// the context, and record the options (weakly: the record goes with the
// task) so that Client can do that. A task from asynq.NewTask that needs a
// token is refused with ErrForeignTask rather than enqueued without its
// options or without its token; one that needs nothing passes untouched.
// To find, before run time, the asynq.NewTask calls whose tasks reach
// Client, run go vet -vettool=$(which caughtupvet) ./... (cmd/caughtupvet,
// the analyzer of package foreigntask).
// The task asynq hands a handler can be enqueued again as it is: asynq
// builds it without options. Options given to EnqueueContext work as in
// asynq.
//
// # Deferral, last attempts and deduplicated tasks
//
// A Delayed task whose replicas are all behind waits in the middleware up
// to the router's WaitBudget, then is deferred without spending a retry
// (the server hooks), and is moved to pending as soon as the tracker sees
// a replica past its token; the delay is only the safety net. A task on
// its last attempt, or whose absolute deadline is near, is never deferred:
// it reads a caught-up replica or the primary, charged to the fallback cap,
// and is held in its worker while the cap is spent. A task that may stand
// for duplicates asynq rejected (asynq.Unique, asynq.TaskID; or any
// stamped task enqueued by a plain *asynq.Client or a Scheduler, whose
// options caughtup cannot see) is routed against the primary's position
// at the start of each attempt. GroupAggregator tasks carry their group's
// merged token. The details are in docs/asynq.md.
//
// # Metrics
//
// Under ScopeName: caughtup.asynq.overrides (caughtup.asynq.override
// last_attempt, deadline, deadline_unknown or dedup_capture_failed),
// caughtup.asynq.hooks.missing (caughtup.asynq.hook IsFailure or
// RetryDelayFunc), caughtup.asynq.aggregates.unstamped,
// caughtup.asynq.wake.tasks, .wake.remembered, .wake.dropped (evicted,
// expired) and caughtup.asynq.wake.errors (error.type not_found, active,
// pending, finished, changed, raced, redis). Routing decisions are counted
// by package consume.
//
// # Traces
//
// NewTask writes the trace context of its ctx into the task's headers
// through the global propagators (otel.SetTextMapPropagator; none by
// default), and the middleware continues it (MiddlewareConfig.Propagators)
// unless the handler's context already has a span, so the routing spans
// and the handler's join the trace that enqueued the task, attempt after
// attempt. Under ScopeName, from MiddlewareConfig.TracerProvider:
// consume.SpanDefer for each deferral and consume.SpanWake for each move
// of caught-up tasks to pending, linked to their deferrals' spans.
package caughtupasynq
