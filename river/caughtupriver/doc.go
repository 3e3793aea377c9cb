// Package caughtupriver is caughtup's adapter for github.com/riverqueue/river
// (v0.51, pgx driver riverpgxv5): worker middleware that runs each job on a
// replica that has replayed the writes before it, snoozing the job without
// spending an attempt while none has, and insert helpers that carry the
// producer's token in the job's metadata.
//
// River inserts jobs in the business transaction (InsertTx), so no token
// exists when the job is written. It needs none: River fetches only
// committed jobs, and the primary's WAL position read after the fetch
// covers the job's transaction. The Middleware reads it, once for every
// job waiting at the moment (one query per fetched batch, not per job), and
// routes the job against it. Each such read first scans River's table for
// the jobs committed and waiting then: they get the read's position too,
// and need no read of their own when their turn comes (a backlog costs a
// read per 2,000 jobs, made ahead of the fetches). A job inserted after the
// commit, with Insert or InsertMany and the context enqueue.Commit or
// enqueue.InTx returned (or from a routed handler), carries that commit's
// token in its metadata instead, and costs no read.
//
// A worker and a producer, beside River itself:
//
//	import (
//		"context"
//
//		"github.com/jackc/pgx/v5"
//		"github.com/jackc/pgx/v5/pgxpool"
//		"github.com/riverqueue/river"
//		"github.com/riverqueue/river/riverdriver/riverpgxv5"
//		"github.com/riverqueue/river/rivertype"
//
//		"github.com/caughtup/caughtup/consume"
//		"github.com/caughtup/caughtup/enqueue"
//		"github.com/caughtup/caughtup/river/caughtupriver"
//	)
//
//	type EmailArgs struct {
//		UserID int64 `json:"user_id"`
//	}
//
//	func (EmailArgs) Kind() string { return "email_send" }
//
//	// A worker takes its pool from the context.
//	type EmailWorker struct {
//		river.WorkerDefaults[EmailArgs]
//	}
//
//	func (w *EmailWorker) Work(ctx context.Context, job *river.Job[EmailArgs]) error {
//		var email string // on a replica that has the job's writes
//		return consume.DB(ctx, "main").QueryRow(ctx, "SELECT email FROM users WHERE id = $1", job.Args.UserID).Scan(&email)
//	}
//
//	// One router per process (consume.NewRouter), the middleware on the client.
//	func newClient(router *consume.Router, primary *pgxpool.Pool) (*river.Client[pgx.Tx], error) {
//		mw, err := caughtupriver.NewMiddleware(router, caughtupriver.Config{
//			Policies: map[string]consume.Policy{"email_send": consume.Delayed},
//		})
//		if err != nil {
//			return nil, err
//		}
//		workers := river.NewWorkers()
//		if err := river.AddWorkerSafely(workers, &EmailWorker{}); err != nil {
//			return nil, err
//		}
//		return river.NewClient(riverpgxv5.New(primary), &river.Config{
//			Queues:     map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 20}},
//			Workers:    workers,
//			Middleware: []rivertype.Middleware{mw},
//		})
//	}
//
//	// Producer: InsertTx as usual (routed by a position read after its commit) ...
//	func signUpTx(ctx context.Context, primary *pgxpool.Pool, client *river.Client[pgx.Tx], email string) error {
//		tx, err := primary.Begin(ctx)
//		if err != nil {
//			return err
//		}
//		defer tx.Rollback(ctx) // after Commit, a no-op
//		var id int64
//		if err := tx.QueryRow(ctx, "INSERT INTO users (email) VALUES ($1) RETURNING id", email).Scan(&id); err != nil {
//			return err
//		}
//		if _, err := client.InsertTx(ctx, tx, EmailArgs{UserID: id}, nil); err != nil {
//			return err
//		}
//		return tx.Commit(ctx)
//	}
//
//	// ... or Insert after the commit (routed by the commit's token, no read).
//	func signUp(ctx context.Context, primary *pgxpool.Pool, client *river.Client[pgx.Tx], email string) error {
//		var id int64
//		ctx, err := enqueue.InTx(ctx, primary, func(tx pgx.Tx) error {
//			return tx.QueryRow(ctx, "INSERT INTO users (email) VALUES ($1) RETURNING id", email).Scan(&id)
//		})
//		if err != nil {
//			return err
//		}
//		_, err = caughtupriver.Insert(ctx, client, EmailArgs{UserID: id}, nil)
//		return err
//	}
//
// # What it costs
//
// A position read after the fetch is past whatever River wrote since
// (fetches, completions of other jobs), so a replica must replay that as
// well: the jobs that wait for such a read also wait in the Middleware for
// the tracker's next observation (consume.Config.WaitBudget), a few
// milliseconds. Jobs an earlier read's scan saw waiting were committed
// before that read, whose position the replicas have usually replayed by
// their fetch: they route at once, as jobs with a metadata token (which
// names the producer's commit exactly) do. See BenchmarkThroughput.
//
// So give jobs inserted with InsertTx the Delayed policy. Sticky, which
// never waits, sends nearly every one of them to the primary under the
// fallback cap (a chaos probe without any fault: 9% replica reads), where
// the refusals of a spent cap retry against newer positions; the cap is
// per process, so they spend it for the process's other queues too.
// Metadata tokens (Insert) do not have this cost.
//
// River writes some 4 KiB of WAL per job (7 KiB when snoozed), which a
// long replica pause adds to its lag (replay.TrackerConfig.MaxLagBytes).
//
// # Deferral
//
// A Delayed job no replica serves within the router's wait is snoozed
// (river.JobSnooze) for the router's delay: River restores JobRow.Attempt
// and records no error, so deferral never spends MaxAttempts. The router
// bounds it by the job's age (consume.Config.MaxAge, from the metadata
// token's capture or the job's CreatedAt); after that the job reads the
// primary under the fallback cap. A job on its last attempt is held in its
// worker rather than failed by the cap.
//
// A snoozed job is woken as soon as a replica has replayed its token, as
// asynq's deferred tasks are: the Middleware remembers its snoozes
// (Config.WakeCapacity) and, on every tracker snapshot, makes the jobs
// whose tokens are caught up available again, up to 1,000 per UPDATE
// through the job's River client's driver, with River's insert
// notification so that the producers fetch them at once. The UPDATE moves
// a job only if its row is still in the snooze the Middleware returned
// (scheduled, the attempt River gave back, the snooze count River wrote),
// and changes its state and scheduled_at alone: it never spends an
// attempt, never raises max_attempts, never runs a finished job again
// (River's JobRetry would do the last two). A woken job is routed again:
// still behind, it snoozes again, for free. The snooze is the safety net:
// a job no one wakes (its process died or stopped) runs when its snooze
// ends. A job routed by a position read for it keeps that position in its
// metadata (caughtup-snoozed) when it is snoozed, and its next fetch is
// routed by it, without a read, if the job comes back straight out of
// that snooze or its wake (caughtup-woken): the same attempt, the same
// snooze count, and not made available early by something else, such as
// River's JobRetry, whose transaction's writes a new read covers.
//
// Metadata that does not decode sends the job to the primary, counted and
// logged (rate-limited) by the router under the source "river <kind>";
// it never fails the job. So does a failed read of the primary's
// position (caughtup.river.tokens fetch_failed).
//
// # Metrics
//
// Under ScopeName: caughtup.river.tokens (caughtup.river.token metadata,
// fetch, earlier_read, snoozed, metadata_fetch, malformed, none,
// fetch_failed, always), caughtup.river.position.reads (caughtup.result ok,
// failed), caughtup.river.overrides (caughtup.river.override last_attempt,
// replica_failed), and the wake's, named as asynq's:
// caughtup.river.wake.jobs (woken), caughtup.river.wake.errors (by
// error.type: not_found, running, available, finished, changed,
// database), caughtup.river.wake.dropped (caughtup.river.wake.reason
// evicted, expired, stopped) and caughtup.river.wake.remembered. A wake
// statement that fails is logged once, and its recovery once, not per job.
// Routing decisions are counted by package consume.
//
// # Traces
//
// Each snooze is a consume.SpanDefer span under ScopeName, from
// Config.TracerProvider, with the decision and the job (messaging.system
// river, the queue, the job's id, caughtup.river.kind); each attempt's
// routing is the router's consume.SpanRoute. Both are children of the
// worker's context's span: otelriver's (rivercontrib), if its middleware
// runs before this one. Each wake statement is a consume.SpanWake span
// linked to the snoozes' spans it ends (when any was sampled).
package caughtupriver
