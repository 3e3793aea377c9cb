package caughtupasynq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
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
	// wakeScripts bounds the wakeMoveScript calls in flight (moveWith):
	// Redis runs one at a time; a few in flight keep it busy while the
	// results of the last one are handled here.
	wakeScripts = 4
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

// String is the attribute value ("not_found", "active", …).
func (k wakeError) String() string {
	if int(k) < len(wakeErrorNames) {
		return wakeErrorNames[k]
	}
	return "wakeError(" + strconv.Itoa(int(k)) + ")"
}

const attrWakeDrop = "caughtup.asynq.wake.reason"

// wakeMetrics are the waker's synchronous instruments. The set's size is
// an UpDownCounter rather than an observable gauge: Middleware has no
// Close to unregister a callback with, and the count stays right across
// Shutdown, which empties the set, and across several middlewares on one
// MeterProvider, whose sets add up.
type wakeMetrics struct {
	woken      metric.Int64Counter
	errs       metric.Int64Counter
	errSets    [numWakeErrors]metric.AddOption
	dropped    metric.Int64Counter
	evicted    metric.AddOption
	expired    metric.AddOption
	remembered metric.Int64UpDownCounter
	system     metric.AddOption
}

func newWakeMetrics(mp metric.MeterProvider) (*wakeMetrics, error) {
	meter := mp.Meter(ScopeName)
	system := semconv.MessagingSystemKey.String("asynq")
	m := &wakeMetrics{system: metric.WithAttributeSet(attribute.NewSet(system))}
	var err error
	wrap := func(name string, err error) error {
		return fmt.Errorf("caughtup/asynq: creating %s: %w", name, err)
	}
	if m.woken, err = meter.Int64Counter("caughtup.asynq.wake.tasks",
		metric.WithUnit("{task}"),
		metric.WithDescription("Deferred tasks moved to pending (asynq Inspector.RunTask) as soon as a replica had replayed their token, instead of when their deferral delay ended.")); err != nil {
		return nil, wrap("caughtup.asynq.wake.tasks", err)
	}
	if m.errs, err = meter.Int64Counter("caughtup.asynq.wake.errors",
		metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts to wake a deferred task that did not move it, by error.type (not_found, active, pending, finished, changed, raced, redis); the task runs when its delay ends, or already ran.")); err != nil {
		return nil, wrap("caughtup.asynq.wake.errors", err)
	}
	for k := range wakeError(numWakeErrors) {
		m.errSets[k] = metric.WithAttributeSet(attribute.NewSet(system, semconv.ErrorTypeKey.String(k.String())))
	}
	if m.dropped, err = meter.Int64Counter("caughtup.asynq.wake.dropped",
		metric.WithUnit("{task}"),
		metric.WithDescription("Deferred tasks forgotten before a replica caught up, by caughtup.asynq.wake.reason: evicted (the set was full; raise MiddlewareConfig.WakeCapacity) or expired (their delay ended first).")); err != nil {
		return nil, wrap("caughtup.asynq.wake.dropped", err)
	}
	m.evicted = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrWakeDrop, "evicted")))
	m.expired = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrWakeDrop, "expired")))
	if m.remembered, err = meter.Int64UpDownCounter("caughtup.asynq.wake.remembered",
		metric.WithUnit("{task}"),
		metric.WithDescription("Deferred tasks the process remembers, to run them as soon as a replica has replayed their token (bounded by MiddlewareConfig.WakeCapacity).")); err != nil {
		return nil, wrap("caughtup.asynq.wake.remembered", err)
	}
	return m, nil
}

// taskKey names an asynq task: its id is unique within its queue.
type taskKey struct{ queue, id string }

// wakeTask is what the waker keeps of a deferral besides its token.
type wakeTask struct {
	// retried is the task's retry count when it was deferred; a deferral
	// leaves it as it is, so a task showing another count has failed (or
	// was judged without ServerConfig's IsFailure) since.
	retried int
	// deferral is the span context of the deferral's caughtup.defer span,
	// for the wake span's link; nil when it was not sampled.
	deferral *trace.SpanContext
}

// wakeEntry is a task the middleware deferred. A task that was not
// movable yet (wakeActive, wakeRaced, wakeRedis) is tried again after
// the set's backoff (wakeset.RetryMin to wakeset.RetryMax).
type wakeEntry = wakeset.Entry[taskKey, wakeTask]

// waker runs deferred tasks as soon as a replica has replayed their token.
// The middleware remembers each deferral (remember) in a bounded set and
// forgets a task when it comes back (forget). A goroutine, started with
// the first remembered task and ended when the set is empty (or by close),
// looks at the set on every snapshot the router publishes and moves each
// task whose token is caught up to pending, through the Inspector, if
// asynq still shows it in the retry set as this deferral left it.
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
// Given a Redis client (moveWith), the waker instead moves tasks with
// wakeMoveScript, which checks the state and the retry count and moves
// in one script: no window remains.
type waker struct {
	router *consume.Router
	rcfg   consume.Config
	insp   *asynq.Inspector
	rdb    redis.UniversalClient // set by moveWith: moves by wakeMoveScript
	met    *wakeMetrics
	tracer trace.Tracer
	log    *slog.Logger
	warn   *rate.Sometimes

	size atomic.Int64 // len(set), read without the lock on every task

	mu      sync.Mutex
	set     *wakeset.Set[taskKey, wakeTask]
	running bool
	closed  bool
	kick    chan struct{}
	done    chan struct{}
	wg      sync.WaitGroup
}

func newWaker(router *consume.Router, insp *asynq.Inspector, capacity int, mp metric.MeterProvider, tracer trace.Tracer, log *slog.Logger) (*waker, error) {
	met, err := newWakeMetrics(mp)
	if err != nil {
		return nil, err
	}
	return &waker{
		router: router,
		rcfg:   router.Config(),
		insp:   insp,
		met:    met,
		tracer: tracer,
		log:    log,
		warn:   &rate.Sometimes{First: 1, Interval: time.Minute},
		set:    wakeset.New[taskKey, wakeTask](capacity),
		kick:   make(chan struct{}, 1),
		done:   make(chan struct{}),
	}, nil
}

// moveWith makes w move caught-up tasks with wakeMoveScript on c (the
// Redis the server's tasks are in), wakeBatch tasks per call per queue,
// instead of an Inspector.GetTaskInfo and RunTask per task: a drain of
// thousands of deferred tasks then costs Redis about what asynq's own
// forwarder does, and the check and the move are one step, so the window
// the lookup leaves (see waker) is closed. c is not closed by w. Call it
// before the waker's first remember.
func (w *waker) moveWith(c redis.UniversalClient) { w.rdb = c }

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
	e := &wakeEntry{
		Key:     taskKey{queue: queue, id: id},
		Token:   tok,
		Expires: now.Add(retryDelay(delay, now) + wakeGrace),
		Data:    wakeTask{retried: retried},
	}
	if deferral.IsValid() && deferral.IsSampled() {
		e.Data.deferral = &deferral
	}
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	replaced, evicted := w.set.Add(e)
	w.size.Store(int64(w.set.Len()))
	if !w.running {
		w.running = true
		w.wg.Add(1)
		go w.run()
	}
	w.mu.Unlock()
	if !replaced {
		w.met.remembered.Add(ctx, 1-int64(evicted), w.met.system)
	} else if evicted > 0 {
		w.met.remembered.Add(ctx, -int64(evicted), w.met.system)
	}
	if evicted > 0 {
		w.met.dropped.Add(ctx, int64(evicted), w.met.evicted)
	}
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// forget drops the task ctx belongs to: it is running here again.
func (w *waker) forget(ctx context.Context) {
	if w.size.Load() == 0 {
		return
	}
	id, ok := asynq.GetTaskID(ctx)
	if !ok {
		return
	}
	queue, _ := asynq.GetQueueName(ctx)
	w.mu.Lock()
	gone := w.set.Forget(taskKey{queue: queue, id: id})
	w.size.Store(int64(w.set.Len()))
	w.mu.Unlock()
	if gone {
		w.met.remembered.Add(ctx, -1, w.met.system)
	}
}

// close stops the goroutine and forgets every task; they run when their
// delays end.
func (w *waker) close() {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	w.closed = true
	n := w.set.Len()
	w.set = wakeset.New[taskKey, wakeTask](w.set.Capacity())
	w.size.Store(0)
	close(w.done)
	w.mu.Unlock()
	w.wg.Wait()
	if n > 0 {
		w.met.remembered.Add(context.Background(), -int64(n), w.met.system)
	}
}

// run looks at the set on every new snapshot, new entry and retry or
// expiry time, until the set is empty or the waker is closed. While any
// task waits it makes the tracker poll the replicas of the databases the
// tasks wait on every WaitPollInterval (consume.Router.Watch), as a job
// waiting in Route does: the wake follows the catch-up within
// milliseconds, and the load on a replica stays bounded per process.
func (w *waker) run() {
	defer w.wg.Done()
	stopWatch := func() {}
	defer func() { stopWatch() }()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var (
		due []*wakeEntry
		buf []position.Entry
	)
	ctx := context.Background()
	for {
		snap := w.router.Snapshot()
		now := time.Now()
		w.mu.Lock()
		if w.closed || w.set.Len() == 0 {
			w.running = false
			w.mu.Unlock()
			return
		}
		expired := w.set.Expire(now)
		due = w.set.Scan(snap, w.rcfg.Now(), &w.rcfg, now, due[:0])
		watched := w.set.Watched(buf)
		buf = watched.Entries
		next := w.set.Next()
		w.size.Store(int64(w.set.Len()))
		w.mu.Unlock()
		if expired > 0 {
			w.met.remembered.Add(ctx, -int64(expired), w.met.system)
			w.met.dropped.Add(ctx, int64(expired), w.met.expired)
		}
		// Watch again each round (the replicas that answer change); the
		// new watch starts before the old one ends, so the pace holds.
		nextWatch := w.router.Watch(watched)
		stopWatch()
		stopWatch = nextWatch

		if len(due) > 0 {
			w.attemptAll(due)
			clear(due)
			continue
		}
		var tc <-chan time.Time
		if !next.IsZero() {
			timer.Reset(max(time.Until(next), 0))
			tc = timer.C
		}
		select {
		case <-snap.Changed():
		case <-w.kick:
		case <-tc:
		case <-w.done:
		}
		timer.Stop()
	}
}

// attemptAll tries to move every due task, wakeWorkers at a time (or
// with moveAll), and starts no more once the waker is closed (close
// forgets them all).
func (w *waker) attemptAll(due []*wakeEntry) {
	if w.rdb != nil {
		w.moveAll(due)
		return
	}
	sem := make(chan struct{}, wakeWorkers)
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, e := range due {
		select {
		case sem <- struct{}{}:
		case <-w.done:
			return
		}
		wg.Go(func() {
			defer func() { <-sem }()
			_, span := w.startWake(context.Background(), e.Key.queue, []*wakeEntry{e})
			r := w.attempt(e)
			w.finish(e, r)
			endWake(span, b2i(r.woken))
		})
	}
}

// moveAll moves every due task with wakeMoveScript, wakeBatch tasks of
// one queue per call, wakeScripts calls at a time.
func (w *waker) moveAll(due []*wakeEntry) {
	byQueue := map[string][]*wakeEntry{}
	for _, e := range due {
		byQueue[e.Key.queue] = append(byQueue[e.Key.queue], e)
	}
	sem := make(chan struct{}, wakeScripts)
	var wg sync.WaitGroup
	defer wg.Wait()
	for queue, es := range byQueue {
		for len(es) > 0 {
			batch := es[:min(len(es), wakeBatch)]
			es = es[len(batch):]
			select {
			case sem <- struct{}{}:
			case <-w.done:
				return
			}
			wg.Go(func() {
				defer func() { <-sem }()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				ctx, span := w.startWake(ctx, queue, batch)
				woken := 0
				for i, r := range moveBatch(ctx, w.rdb, queue, batch) {
					w.finish(batch[i], r)
					if r.woken {
						woken++
					}
				}
				endWake(span, woken)
			})
		}
	}
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

// finish records an attempt and updates the set.
func (w *waker) finish(e *wakeEntry, r attemptResult) {
	ctx := context.Background()
	w.mu.Lock()
	cur := w.set.Current(e)
	switch {
	case !cur:
		// Forgotten (the task came back), replaced (deferred again) or
		// evicted meanwhile: the set has already accounted for it.
	case r.retry:
		w.set.RetryAfter(e, time.Now())
	default:
		w.set.Remove(e)
		w.size.Store(int64(w.set.Len()))
	}
	w.mu.Unlock()
	if cur && !r.retry {
		w.met.remembered.Add(ctx, -1, w.met.system)
	}
	if r.woken {
		w.met.woken.Add(ctx, 1, w.met.system)
		w.log.LogAttrs(ctx, slog.LevelDebug, "caughtup: a replica has replayed a deferred task's token; moved it to pending",
			slog.String("messaging.system", "asynq"), slog.String("messaging.destination.name", e.Key.queue),
			slog.String("messaging.message.id", e.Key.id))
		return
	}
	w.met.errs.Add(ctx, 1, w.met.errSets[r.err])
	if r.err == wakeRedis {
		w.warn.Do(func() {
			w.log.LogAttrs(ctx, slog.LevelWarn, "caughtup: could not look up or run a deferred task whose token a replica has replayed; trying again, and it runs when its delay ends anyway",
				slog.String("messaging.system", "asynq"), slog.String("messaging.destination.name", e.Key.queue), slog.Any("error", r.cause))
		})
	}
}

// startWake starts the caughtup.wake span of one move of es, the due
// tasks of queue, linked to the spans of their deferrals that were traced.
func (w *waker) startWake(ctx context.Context, queue string, es []*wakeEntry) (context.Context, trace.Span) {
	var links []trace.Link
	for _, e := range es {
		if e.Data.deferral != nil {
			links = append(links, trace.Link{SpanContext: *e.Data.deferral})
		}
	}
	if len(links) == 0 {
		return ctx, tracenoop.Span{} // no deferral of these was in a trace
	}
	return w.tracer.Start(ctx, consume.SpanWake, trace.WithLinks(links...), trace.WithAttributes(
		systemAsynq, attribute.String(attrDestination, queue), attribute.Int(attrBatchCount, len(es))))
}

// endWake ends a caughtup.wake span with how many of its tasks it moved.
func endWake(span trace.Span, woken int) {
	span.SetAttributes(attribute.Int(attrWoken, woken))
	span.End()
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
