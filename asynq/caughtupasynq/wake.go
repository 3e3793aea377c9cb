package caughtupasynq

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume/wake"
	"github.com/caughtup/caughtup/consume/wakeset"
	"github.com/caughtup/caughtup/position"
)

// DefaultWakeCapacity is MiddlewareConfig.WakeCapacity's default: the
// deferred tasks one process remembers, about 4 MB (see WakeCapacity).
const DefaultWakeCapacity = 10_000

const (
	// wakeGrace is how long after its deferral delay a task is still
	// remembered: asynq's forwarder moves due tasks every
	// DelayedTaskCheckInterval, 5s by default (1s with ServerConfig).
	wakeGrace = 5 * time.Second
	// wakeWorkers bounds the Redis calls in flight when many tasks catch
	// up at once (each wake is two lookups, GetTaskInfo then RunTask).
	wakeWorkers = 16
	// wakeScripts bounds the wakeMoveScript calls in flight (with Redis):
	// Redis runs one at a time; a few in flight keep it busy while the
	// results of the last one are handled here.
	wakeScripts = 4
	// wakeTimeout bounds one wakeMoveScript call.
	wakeTimeout = 10 * time.Second
)

// wakeError names why an attempt to wake a deferred task did not move it
// to pending, as the error.type attribute of caughtup.asynq.wake.errors.
// None of them reaches the task or the user: the task runs when its own
// delay ends, or already ran.
type wakeError uint8

const (
	// wakeNotFound: the task (or its queue) is gone: deleted, or completed
	// without asynq.Retention. Forgotten.
	wakeNotFound wakeError = iota
	// wakeActive: the task is running: asynq had not yet moved it to the
	// retry set after the middleware deferred it, or a worker is running
	// it. Tried again with a backoff, until it leaves that state or its
	// delay ends.
	wakeActive
	// wakePending: the task is already waiting for a worker (its delay
	// ended, or another process woke it). Forgotten.
	wakePending
	// wakeFinished: the task completed (asynq.Retention) or was archived;
	// RunTask would run it again. Forgotten, never run.
	wakeFinished
	// wakeChanged: the task is no longer this deferral's: its retry count
	// grew (a handler error since, whose backoff is asynq's) or it is
	// scheduled or aggregating. Forgotten.
	wakeChanged
	// wakeRaced: RunTask refused a task that the lookup just before had
	// shown in the retry set: something else moved it in between (its
	// delay ended and the forwarder ran). Tried again, which finds out
	// what became of it.
	wakeRaced
	// wakeRedis: a lookup or RunTask failed (Redis unreachable, the
	// inspector closed). Tried again with a backoff until the task's
	// delay ends.
	wakeRedis

	numWakeErrors = int(wakeRedis) + 1
)

var wakeErrorNames = [numWakeErrors]string{
	wakeNotFound: "not_found",
	wakeActive:   "active",
	wakePending:  "pending",
	wakeFinished: "finished",
	wakeChanged:  "changed",
	wakeRaced:    "raced",
	wakeRedis:    "redis",
}

const attrWakeDrop = "caughtup.asynq.wake.reason"

// wakeInstruments are the waker's metrics (see wake.Instruments).
var wakeInstruments = wake.Instruments{
	Woken: wake.Instrument{Name: "caughtup.asynq.wake.tasks", Unit: "{task}",
		Description: "Deferred tasks moved to pending (asynq Inspector.RunTask) as soon as a replica had replayed their token, instead of when their deferral delay ended."},
	Errors: wake.Instrument{Name: "caughtup.asynq.wake.errors", Unit: "{attempt}",
		Description: "Attempts to wake a deferred task that did not move it, by error.type (not_found, active, pending, finished, changed, raced, redis); the task runs when its delay ends, or already ran."},
	ErrorTypes: wakeErrorNames[:],
	Dropped: wake.Instrument{Name: "caughtup.asynq.wake.dropped", Unit: "{task}",
		Description: "Deferred tasks forgotten before a replica caught up, by caughtup.asynq.wake.reason: evicted (the set was full; raise MiddlewareConfig.WakeCapacity) or expired (their delay ended first)."},
	DropReason: attrWakeDrop,
	Remembered: wake.Instrument{Name: "caughtup.asynq.wake.remembered", Unit: "{task}",
		Description: "Deferred tasks the process remembers, to run them as soon as a replica has replayed their token (bounded by MiddlewareConfig.WakeCapacity)."},
}

// taskKey names an asynq task: its id is unique within its queue.
type taskKey struct{ queue, id string }

// wakeTask is what the waker keeps of a deferral besides its token and
// span.
type wakeTask struct {
	// retried is the task's retry count when it was deferred; a deferral
	// leaves it as it is, so a task showing another count has failed (or
	// was judged without ServerConfig's IsFailure) since.
	retried int
}

// wakeEntry is a task the middleware deferred. A task that was not
// movable yet (wakeActive, wakeRaced, wakeRedis) is tried again after
// the set's backoff (wakeset.RetryMin to wakeset.RetryMax).
type wakeEntry = wakeset.Entry[taskKey, wakeTask]

// waker runs deferred tasks as soon as a replica has replayed their token.
// The middleware remembers each deferral (remember) and forgets a task
// when it comes back (forget); the loop is wake.Waker's, which hands each
// task whose token is caught up to Move (the waker is its wake.Mover),
// which moves it to pending if asynq still shows it in the retry set as
// this deferral left it.
//
// Why no task runs twice, and why no error reaches anyone: RunTask is
// called only for a task that GetTaskInfo, one round trip earlier, showed
// in the retry state with the retry count of the deferral. RunTask itself
// refuses active and pending tasks, and asynq moves a task out of the
// retry set (forwarder or RunTask) in one Redis script, so a task woken
// here and made due by its delay is pending once. What the lookup guards
// against is RunTask's one dangerous case: it also moves completed tasks
// (kept by asynq.Retention) and archived ones back to pending. asynq has
// no conditional move, so a window of one round trip remains: a task the
// forwarder moved, a worker ran to its end and asynq kept as completed or
// archived, all between the lookup and RunTask, would run again. Every
// other outcome (deleted, running, pending, finished, failed since) is
// counted as a wakeError and forgotten or tried again later; the task's
// own delay, with which asynq scheduled it, still runs it if this
// process dies or forgets it. RunTask does not touch the retry count.
// Given a Redis client (rdb), the waker instead moves tasks with
// wakeMoveScript, which checks the state and the retry count and moves
// in one script: no window remains.
type waker struct {
	*wake.Waker[taskKey, wakeTask]
	insp *asynq.Inspector
	rdb  redis.UniversalClient // not nil: moves by wakeMoveScript
	log  *slog.Logger
	warn *rate.Sometimes
}

var _ wake.Mover[taskKey, wakeTask] = (*waker)(nil)

// newWaker returns a waker that moves tasks with wakeMoveScript on rdb
// (the Redis the server's tasks are in), wakeBatch tasks per call per
// queue, or, with a nil rdb, with an Inspector.GetTaskInfo and RunTask per
// task. The script makes a drain of thousands of deferred tasks cost Redis
// about what asynq's own forwarder does, and the check and the move are
// one step, so the window the lookup leaves (see waker) is closed. rdb is
// not closed by the waker.
func newWaker(router wake.Router, insp *asynq.Inspector, rdb redis.UniversalClient, capacity int, mp metric.MeterProvider, tracer trace.Tracer, log *slog.Logger) (*waker, error) {
	w := &waker{insp: insp, rdb: rdb, log: log, warn: &rate.Sometimes{First: 1, Interval: time.Minute}}
	cfg := wake.Config{
		Capacity: capacity, Batch: 1, Moves: wakeWorkers,
		System: "asynq", Instruments: wakeInstruments, WokenAttribute: attrWoken,
		SpanAttributes: func(queue any) []attribute.KeyValue {
			return []attribute.KeyValue{attribute.String(attrDestination, queue.(string))}
		},
		Meter: mp.Meter(ScopeName), Tracer: tracer,
	}
	if rdb != nil {
		cfg.Batch, cfg.Moves, cfg.Timeout = wakeBatch, wakeScripts, wakeTimeout
	}
	var err error
	if w.Waker, err = wake.New[taskKey, wakeTask](router, w, cfg); err != nil {
		return nil, err
	}
	return w, nil
}

// remember notes that the middleware is deferring the task ctx belongs
// to, until tok is caught up, for delay; deferral is the deferral's span,
// which the wake's links to when it is being traced.
func (w *waker) remember(ctx context.Context, tok position.Token, delay time.Duration, deferral trace.SpanContext) {
	id, ok := asynq.GetTaskID(ctx)
	if !ok || tok.IsZero() {
		return // not run by asynq's server, or nothing to wait for
	}
	queue, _ := asynq.GetQueueName(ctx)
	retried, _ := asynq.GetRetryCount(ctx)
	now := time.Now()
	w.Remember(ctx, &wakeEntry{
		Key:     taskKey{queue: queue, id: id},
		Token:   tok,
		Expires: now.Add(retryDelay(delay, now) + wakeGrace),
		Data:    wakeTask{retried: retried},
	}, deferral)
}

// forget drops the task ctx belongs to: it is running here again.
func (w *waker) forget(ctx context.Context) {
	if w.Len() == 0 {
		return
	}
	if id, ok := asynq.GetTaskID(ctx); ok {
		queue, _ := asynq.GetQueueName(ctx)
		w.Forget(ctx, taskKey{queue: queue, id: id})
	}
}

// close stops the waker and forgets every task; they run when their
// delays end.
func (w *waker) close() { w.Close() }

// Group is the task's queue: the script moves tasks of one queue per
// call (its keys share the queue's Redis Cluster slot), and the wake span
// names it.
func (w *waker) Group(k taskKey) any { return k.queue }

// Move moves batch, tasks of one queue: with one wakeMoveScript call, or,
// without Redis, the one task by lookup and RunTask.
func (w *waker) Move(ctx context.Context, batch []*wakeEntry) []wake.Result {
	var rs []attemptResult
	if w.rdb != nil {
		rs = moveBatch(ctx, w.rdb, batch[0].Key.queue, batch)
	} else {
		rs = []attemptResult{w.attempt(batch[0])}
	}
	out := make([]wake.Result, len(rs))
	for i, r := range rs {
		w.report(batch[i], r)
		out[i] = wake.Result{Woken: r.woken, Err: int(r.err), Retry: r.retry}
	}
	return out
}

// attemptResult is what one attempt found.
type attemptResult struct {
	woken bool
	err   wakeError
	retry bool // the task may still be movable: try again later
	cause error
}

// attempt moves e's task to pending if asynq still shows it in the retry
// set with the retry count of the deferral.
func (w *waker) attempt(e *wakeEntry) attemptResult {
	q, id := e.Key.queue, e.Key.id
	info, err := w.insp.GetTaskInfo(q, id)
	if err != nil {
		return lookupFailed(err)
	}
	switch info.State {
	case asynq.TaskStateRetry:
		if info.Retried != e.Data.retried {
			return attemptResult{err: wakeChanged}
		}
	case asynq.TaskStateActive:
		return attemptResult{err: wakeActive, retry: true}
	case asynq.TaskStatePending:
		return attemptResult{err: wakePending}
	case asynq.TaskStateCompleted, asynq.TaskStateArchived:
		return attemptResult{err: wakeFinished}
	default:
		return attemptResult{err: wakeChanged}
	}
	err = w.insp.RunTask(q, id)
	switch {
	case err == nil:
		return attemptResult{woken: true}
	case errors.Is(err, asynq.ErrTaskNotFound), errors.Is(err, asynq.ErrQueueNotFound):
		return attemptResult{err: wakeNotFound}
	}
	// RunTask refuses active and pending tasks: the task left the retry
	// set since the lookup. The next attempt's lookup tells what it
	// became, and moves nothing that is not back in the retry set.
	return attemptResult{err: wakeRaced, retry: true, cause: err}
}

func lookupFailed(err error) attemptResult {
	if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
		return attemptResult{err: wakeNotFound}
	}
	return attemptResult{err: wakeRedis, retry: true, cause: err}
}

// report logs a task moved (debug) and, now and then, Redis failing.
func (w *waker) report(e *wakeEntry, r attemptResult) {
	ctx := context.Background()
	switch {
	case r.woken:
		w.log.LogAttrs(ctx, slog.LevelDebug, "caughtup: a replica has replayed a deferred task's token; moved it to pending",
			slog.String("messaging.system", "asynq"), slog.String("messaging.destination.name", e.Key.queue),
			slog.String("messaging.message.id", e.Key.id))
	case r.err == wakeRedis:
		w.warn.Do(func() {
			w.log.LogAttrs(ctx, slog.LevelWarn, "caughtup: could not look up or run a deferred task whose token a replica has replayed; trying again, and it runs when its delay ends anyway",
				slog.String("messaging.system", "asynq"), slog.String("messaging.destination.name", e.Key.queue), slog.Any("error", r.cause))
		})
	}
}
