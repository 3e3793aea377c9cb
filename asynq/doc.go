// Package asynq is caughtup's adapter for github.com/hibiken/asynq: a
// client wrapper that stamps each task with the token of the writes before
// it, a server middleware that runs each task on a replica that has
// replayed them, and the server hooks that let a task wait for a replica
// without spending its retries.
//
// The package is named after the queue it adapts; import it under another
// name next to asynq itself:
//
//	import (
//		"github.com/hibiken/asynq"
//		caughtupasynq "github.com/caughtup/caughtup/asynq"
//	)
//
// Producer: commit, then enqueue with the context the commit returned.
//
//	client := caughtupasynq.NewClient(asynq.NewClient(redisOpt))
//	ctx, err := enqueue.InTx(ctx, pool, func(tx pgx.Tx) error { ... })
//	_, err = client.EnqueueContext(ctx, asynq.NewTask("email:welcome", payload, asynq.MaxRetry(5)))
//
// Worker: one router per process, the hooks on the server, the middleware
// on the mux, and handlers that take their pool from the context.
//
//	router, err := consume.NewRouter(ctx, consume.Config{
//		Databases: map[string]consume.Database{"main": {Primary: primary, Replicas: consume.Replicas(r1, r2)}},
//	})
//	srv := asynq.NewServer(redisOpt, caughtupasynq.ServerConfig(asynq.Config{Concurrency: 20}))
//	mux := asynq.NewServeMux()
//	mux.Use(caughtupasynq.Middleware(router, caughtupasynq.MiddlewareConfig{
//		Policies: map[string]consume.Policy{"email:": consume.Delayed, "billing:": consume.Always},
//	}))
//	mux.HandleFunc("email:welcome", func(ctx context.Context, t *asynq.Task) error {
//		row := consume.DB(ctx, "main").QueryRow(ctx, "SELECT email FROM users WHERE id = $1", id)
//		...
//	})
//	err = srv.Run(mux)
//
// # Deferral and retries
//
// A Delayed task whose replicas are all behind waits in the middleware up
// to the router's WaitBudget, then is deferred: the middleware returns a
// *consume.DeferError, and ServerConfig's hooks make asynq schedule it
// again after the router's delay (rounded up to whole seconds) without
// incrementing its retry count. The router stops deferring once the
// token is older than its MaxAge; the task then reads the primary. Handler
// errors keep asynq's behaviour: retry count, RetryDelayFunc, archive
// after MaxRetry. On a task's last attempt, where asynq would archive it
// on any error, and near its deadline, the middleware never defers (see
// Middleware).
//
// # Tasks enqueued by handlers, unique tasks, groups
//
// A handler's context carries its task's token raised to what the
// replica it read had replayed, so a task it enqueues through Client
// carries the furthest position; a token already in a task's header is
// merged, never lowered. asynq keeps the first of several unique tasks
// (asynq.Unique, asynq.TaskID) and cannot update its headers, so that
// task is routed against the primary's position at its start instead
// (HeaderDedup). ServerConfig stamps tasks built by a GroupAggregator with
// the merged token of their group.
//
// # Options
//
// asynq v0.26 cannot read a task's options back, and headers can only be
// set when a task is built, so Client enqueues a stamped copy of the task
// built with the same options, which it reads from asynq's Task struct
// (checked by field name and type when the package loads). Nothing needs
// to change in how tasks and options are written.
package asynq
