// Package asynq is caughtup's adapter for github.com/hibiken/asynq: a
// client wrapper that stamps each task with the token of the writes before
// it, and a server that runs each task on a replica that has replayed them,
// letting a task wait for a replica without spending its retries.
//
// The package is named after the queue it adapts; import it under another
// name next to asynq itself:
//
//	import (
//		"github.com/hibiken/asynq"
//		"github.com/caughtup/caughtup/asynq/caughtupasynq"
//	)
//
// Producer: commit, then build and enqueue the task with the context the
// commit returned.
//
//	client := caughtupasynq.NewClient(asynq.NewClient(redisOpt))
//	ctx, err := enqueue.InTx(ctx, pool, func(tx pgx.Tx) error { ... })
//	task := caughtupasynq.NewTask(ctx, "email:welcome", payload, asynq.MaxRetry(5))
//	_, err = client.EnqueueContext(ctx, task, asynq.Queue("mail"))
//
// Worker: one router per process, one server, and handlers that take their
// pool from the context.
//
//	router, err := consume.NewRouter(ctx, consume.Config{
//		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(r1, r2)}},
//	})
//	srv, err := caughtupasynq.NewServer(redisOpt, asynq.Config{Concurrency: 20}, router, caughtupasynq.MiddlewareConfig{
//		Policies: map[string]consume.Policy{"email:": consume.Delayed, "billing:": consume.Always},
//	})
//	mux := asynq.NewServeMux()
//	mux.HandleFunc("email:welcome", func(ctx context.Context, t *asynq.Task) error {
//		row := consume.DB(ctx, "main").QueryRow(ctx, "SELECT email FROM users WHERE id = $1", id)
//		...
//	})
//	err = srv.Run(mux)
//
// NewServer is asynq.NewServer with the two pieces that must go together:
// ServerConfig's hooks on the asynq.Config and Middleware around the
// handler. To arrange them yourself (a mux built elsewhere, your own
// middleware outside caughtup's), use both: Middleware reports, as an error
// log and caughtup.asynq.hooks.missing, a deferred task that comes back
// without the hooks. Give that Middleware an Inspector on the same Redis
// (MiddlewareConfig.Inspector: asynq.NewInspector(redisOpt)), as NewServer
// does, so that it wakes deferred tasks (below).
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
// The task asynq hands a handler can be enqueued again as it is: asynq
// builds it without options. Options given to EnqueueContext work as in
// asynq.
//
// # Deferral and retries
//
// A Delayed task whose replicas are all behind waits in the middleware up
// to the router's WaitBudget, then is deferred: the middleware returns a
// *consume.DeferError, and the server hooks make asynq schedule it again
// after the router's delay (rounded up to whole seconds) without
// incrementing its retry count. The router stops deferring once the token
// is older than its MaxAge; the task then reads the primary. Handler
// errors keep asynq's behaviour: retry count, RetryDelayFunc, archive
// after MaxRetry.
//
// The delay is only the safety net. With an Inspector the middleware
// remembers each task it defers (a bounded set per process,
// MiddlewareConfig.WakeCapacity, about 400 bytes a task) and, woken by the
// router's snapshots, moves it to pending (Inspector.RunTask) as soon as
// the tracker sees a replica past its token, typically tens of
// milliseconds after the catch-up instead of one or more seconds. It
// moves only a task that asynq still shows in the retry set with the
// retry count the deferral left; a task since deleted, running, pending,
// completed, archived or failed is forgotten (caughtup.asynq.wake.errors
// by kind), and nothing reaches the task's handler or the server's
// ErrorHandler. A task the process forgets (the set is full, the server
// shuts down, the process dies) runs when its delay ends.
//
// A task is never deferred on its last attempt, where asynq would archive
// it on any error, nor past its absolute deadline. Only an absolute
// deadline limits deferral: asynq.Deadline, or the context's deadline when
// the handler is called directly. asynq.Timeout restarts with every
// attempt, so a Timeout-only task defers like any other. The middleware
// learns a task's Deadline from Redis (NewServer gives it an Inspector) or
// from HeaderDeadline, which Client writes; a task with neither whose
// context deadline is near is assumed to have an absolute one and runs now
// (see Middleware).
//
// # Tasks enqueued by handlers, unique tasks, groups
//
// A handler's context carries its task's token raised to what the replica
// it read had replayed, so a task it enqueues through Client carries the
// furthest position; a token already in a task's header is merged
// (position.MergeHeader), never lowered, and a header that does not decode
// stays as it is, so the consumer reads the primary. asynq keeps the first
// of several unique tasks (asynq.Unique, asynq.TaskID) and cannot update
// its headers, so that task is routed against the primary's position at
// its start instead (HeaderDedup). The server hooks stamp the task a
// GroupAggregator builds with the merged token of its group; build it with
// NewTask too.
package caughtupasynq
