// Package wake runs an adapter's deferred jobs as soon as a replica has
// replayed their token (consume.CaughtUp) rather than when their deferral
// delay ends: the loop around a consume/wakeset.Set that the asynq and
// River adapters share.
//
// The adapter remembers each deferral (Remember) and forgets a job that
// comes back to it (Forget). A goroutine, started with the first
// remembered job and ended when the set is empty (or by Close), looks at
// the set on every snapshot the router publishes, on every new entry and
// at the first expiry or retry time. Meanwhile it makes the tracker poll
// the replicas of the databases the jobs wait on every WaitPollInterval
// (consume.Router.Watch), as a job waiting in Route does: the wake follows
// the catch-up within milliseconds, and the load on a replica stays
// bounded per process. It forgets the jobs whose own delay has brought
// them back (Dropped, "expired") and hands those whose token is caught up
// to the adapter's Mover, in batches of one Group, each Move in a
// consume.SpanWake span linked to the spans of its jobs' deferrals.
//
// The package knows no queue: what moving a job means, and what makes it
// safe (asynq's script that checks the task's state and retry count,
// River's UPDATE under the row's lock) are the Mover's. No error of the
// waker's reaches the job: a job not moved, or forgotten (the set full,
// the process gone), runs when its own delay ends.
//
//	import (
//		"github.com/caughtup/caughtup/consume/wake"
//		"github.com/caughtup/caughtup/consume/wakeset"
//		"go.opentelemetry.io/otel/trace"
//	)
//
//	// defer42 is an adapter's deferral of job "42", whose jobs are keyed
//	// by string and carry an int its Mover checks before moving.
//	func defer42(ctx context.Context, router *consume.Router, mover wake.Mover[string, int], tok position.Token, deferral trace.SpanContext) error {
//		w, err := wake.New[string, int](router, mover, wake.Config{Capacity: 10_000, Batch: 256, Moves: 4, System: "example"})
//		if err != nil {
//			return err
//		}
//		defer w.Close()
//		// The middleware defers the job until tok is caught up, for a minute:
//		w.Remember(ctx, &wakeset.Entry[string, int]{Key: "42", Token: tok, Expires: time.Now().Add(time.Minute)}, deferral)
//		// ... and forgets it when the job runs again, woken or not:
//		w.Forget(ctx, "42")
//		return nil
//	}
package wake
