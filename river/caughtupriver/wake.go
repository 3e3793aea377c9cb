package caughtupriver

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/consume/wakeset"
	"github.com/caughtup/caughtup/position"
)

// DefaultWakeCapacity is Config.WakeCapacity's default: the snoozed jobs
// one process remembers, a few MB.
const DefaultWakeCapacity = 10_000

const (
	// wakeGrace is how long after its snooze ends a job is still
	// remembered: River's scheduler makes due jobs available every 5s
	// (its JobSchedulerIntervalDefault), and a producer fetches them
	// within a FetchPollInterval (1s by default) after that.
	wakeGrace = 7 * time.Second
	// wakeBatch bounds the jobs one wake statement moves: a few
	// milliseconds of the primary's time, row locks held as briefly.
	wakeBatch = 1000
	// wakeStatements bounds the wake statements in flight: one, since
	// concurrent statements, each updating River's indexes where its own
	// fetches insert, took three times as long each, and drained a burst
	// no faster (BenchmarkDrain).
	wakeStatements = 1
	// wakeTimeout bounds one wake statement.
	wakeTimeout = 10 * time.Second
)

// wakeError names why a wake did not make a snoozed job available, as the
// error.type attribute of caughtup.river.wake.errors. None reaches the
// job: it runs when its snooze ends, or already ran.
type wakeError uint8

const (
	// wakeNotFound: the job is gone (deleted). Forgotten.
	wakeNotFound wakeError = iota
	// wakeRunning: the job is running: River's completer had not yet
	// written the snooze when the wake came (it writes in batches), or a
	// worker runs it. Tried again with a backoff until its snooze ends.
	wakeRunning
	// wakeAvailable: the job is already available (its snooze ended, or
	// another process woke it). Forgotten.
	wakeAvailable
	// wakeFinished: completed, cancelled or discarded. Forgotten, never
	// run again (River's JobRetry would run it again: the wake does not
	// use it).
	wakeFinished
	// wakeChanged: the job is no longer in this snooze: it ran since (its
	// attempt or its snooze count differs: a worker's own JobSnooze, an
	// error, a rescue) or is retryable. Forgotten.
	wakeChanged
	// wakeDatabase: the wake statement failed. Tried again with a backoff
	// until the job's snooze ends.
	wakeDatabase

	numWakeErrors = int(wakeDatabase) + 1
)

var wakeErrorNames = [numWakeErrors]string{
	wakeNotFound:  "not_found",
	wakeRunning:   "running",
	wakeAvailable: "available",
	wakeFinished:  "finished",
	wakeChanged:   "changed",
	wakeDatabase:  "database",
}

// String is the attribute value ("not_found", "running", …).
func (k wakeError) String() string {
	if int(k) < len(wakeErrorNames) {
		return wakeErrorNames[k]
	}
	return "wakeError(" + strconv.Itoa(int(k)) + ")"
}

const (
	attrWakeDrop   = "caughtup.river.wake.reason"
	attrWoken      = "caughtup.river.woken"
	attrBatchCount = "messaging.batch.message_count"
)

// wakeMetrics are the waker's instruments, named as asynq's
// (caughtup.asynq.wake.*). remembered is an UpDownCounter rather than an
// observable gauge: the middleware has no Close to unregister a callback
// with, and sets of several middlewares on one MeterProvider add up.
type wakeMetrics struct {
	woken      metric.Int64Counter
	errs       metric.Int64Counter
	errSets    [numWakeErrors]metric.AddOption
	dropped    metric.Int64Counter
	evicted    metric.AddOption
	expired    metric.AddOption
	stopped    metric.AddOption
	remembered metric.Int64UpDownCounter
	system     metric.AddOption
}

func newWakeMetrics(mp metric.MeterProvider) (*wakeMetrics, error) {
	meter := mp.Meter(ScopeName)
	system := semconv.MessagingSystemKey.String("river")
	m := &wakeMetrics{system: metric.WithAttributeSet(attribute.NewSet(system))}
	var err error
	wrap := func(name string, err error) error {
		return fmt.Errorf("caughtup/river: creating %s: %w", name, err)
	}
	if m.woken, err = meter.Int64Counter("caughtup.river.wake.jobs",
		metric.WithUnit("{job}"),
		metric.WithDescription("Snoozed River jobs made available as soon as a replica had replayed their token, instead of when their snooze ended.")); err != nil {
		return nil, wrap("caughtup.river.wake.jobs", err)
	}
	if m.errs, err = meter.Int64Counter("caughtup.river.wake.errors",
		metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts to wake a snoozed River job that did not make it available, by error.type (not_found, running, available, finished, changed, database); the job runs when its snooze ends, or already ran.")); err != nil {
		return nil, wrap("caughtup.river.wake.errors", err)
	}
	for k := range wakeError(numWakeErrors) {
		m.errSets[k] = metric.WithAttributeSet(attribute.NewSet(system, semconv.ErrorTypeKey.String(k.String())))
	}
	if m.dropped, err = meter.Int64Counter("caughtup.river.wake.dropped",
		metric.WithUnit("{job}"),
		metric.WithDescription("Snoozed River jobs forgotten before a replica caught up, by caughtup.river.wake.reason: evicted (the set was full; raise Config.WakeCapacity), expired (their snooze ended first) or stopped (their client stopped).")); err != nil {
		return nil, wrap("caughtup.river.wake.dropped", err)
	}
	m.evicted = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrWakeDrop, "evicted")))
	m.expired = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrWakeDrop, "expired")))
	m.stopped = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrWakeDrop, "stopped")))
	if m.remembered, err = meter.Int64UpDownCounter("caughtup.river.wake.remembered",
		metric.WithUnit("{job}"),
		metric.WithDescription("Snoozed River jobs the process remembers, to make them available as soon as a replica has replayed their token (bounded by Config.WakeCapacity).")); err != nil {
		return nil, wrap("caughtup.river.wake.remembered", err)
	}
	return m, nil
}

// riverClient is the River client of the pgx driver (riverpgxv5), whose
// jobs the waker wakes.
type riverClient = river.Client[pgx.Tx]

// jobKey names a River job: its client (and so its database and schema)
// and its id.
type jobKey struct {
	client *riverClient
	id     int64
}

// wakeJob is what a wake must find in the job's row for the snooze to be
// this one's, and the snooze's span for the wake span's link.
type wakeJob struct {
	// attempt is the row's attempt once River has written the snooze: the
	// fetched attempt minus one (a snooze gives the attempt back).
	attempt int
	// snoozes is the row's metadata "snoozes" once River has written the
	// snooze: one more than the fetched job's.
	snoozes int64
	// deferral is the snooze's caughtup.defer span, nil when not sampled.
	deferral *trace.SpanContext
	// mark: the snooze kept the position the job was routed by
	// (keepSnoozed), so the wake writes wokenKey for snoozedToken.
	mark bool
}

type wakeEntry = wakeset.Entry[jobKey, wakeJob]

// waker makes snoozed jobs available as soon as a replica has replayed
// their token. The middleware remembers each snooze (remember) in a
// bounded set and forgets a job that comes back to it (forget). A
// goroutine, started with the first remembered job and ended when the set
// is empty, looks at the set on every snapshot the router publishes and
// wakes the jobs whose token is caught up, up to wakeBatch per statement
// (wakeSQL), through the job's own River client's driver.
//
// Why a wake never runs a job twice, never runs a finished job, and never
// spends an attempt: the statement makes a job available only if its row
// is still in the state this snooze left it in (scheduled, or available
// with a future scheduled_at; the attempt River gave back; the snooze
// count River wrote), checked and changed in one UPDATE under the row's
// lock, which River's fetch (FOR UPDATE SKIP LOCKED) and completer respect.
// It changes the state and scheduled_at only: the attempt, max_attempts
// and errors stay as the snooze left them. River's JobRetry is not used:
// it makes completed, cancelled and discarded jobs available too, and
// raises max_attempts when the attempts are spent.
//
// Why a wake cannot cause a stale read: a woken job is fetched and routed
// by the Middleware like any other. If its replica fell behind again
// meanwhile, it waits or snoozes again, which spends no attempt.
//
// The snooze itself is the safety net: a job this process forgets (its
// client stopped, the process died, the set was full) runs when its snooze
// ends, as without the waker.
type waker struct {
	router *consume.Router
	rcfg   consume.Config
	met    *wakeMetrics
	tracer trace.Tracer
	log    *slog.Logger

	size atomic.Int64 // set.Len(), read without the lock on every job

	mu      sync.Mutex
	set     *wakeset.Set[jobKey, wakeJob]
	clients map[*riverClient]<-chan struct{} // those watched, to their run's Stopped
	running bool
	kick    chan struct{}
	failing bool // the last wake statement failed (logged once per change)
}

func newWaker(router *consume.Router, capacity int, mp metric.MeterProvider, tracer trace.Tracer, log *slog.Logger) (*waker, error) {
	met, err := newWakeMetrics(mp)
	if err != nil {
		return nil, err
	}
	return &waker{
		router:  router,
		rcfg:    router.Config(),
		met:     met,
		tracer:  tracer,
		log:     log,
		set:     wakeset.New[jobKey, wakeJob](capacity),
		clients: make(map[*riverClient]<-chan struct{}),
		kick:    make(chan struct{}, 1),
	}, nil
}

// snoozeCount is the "snoozes" River reads from a job's metadata (gjson's
// lenient Int: a number, else 0).
func snoozeCount(md []byte) int64 {
	var v struct {
		Snoozes any `json:"snoozes"`
	}
	if json.Unmarshal(md, &v) != nil {
		return 0
	}
	if f, ok := v.Snoozes.(float64); ok {
		return int64(f)
	}
	return 0
}

// remember notes that the middleware is snoozing job, run by the River
// client ctx carries, until tok is caught up, for delay; deferral is the
// snooze's span, kept whether the snooze kept a position (keepSnoozed).
// Jobs of other drivers than riverpgxv5 are not remembered: they run when
// their snooze ends.
func (w *waker) remember(ctx context.Context, job *rivertype.JobRow, tok position.Token, delay time.Duration, deferral trace.SpanContext, kept bool) {
	client, err := river.ClientFromContextSafely[pgx.Tx](ctx)
	if err != nil || tok.IsZero() {
		return
	}
	stopped := client.Stopped()
	if stopped == nil || closed(stopped) {
		return // not started, or stopping: it will not fetch the job
	}
	e := &wakeEntry{
		Key:     jobKey{client: client, id: job.ID},
		Token:   tok,
		Expires: time.Now().Add(delay + wakeGrace),
		Data:    wakeJob{attempt: job.Attempt - 1, snoozes: snoozeCount(job.Metadata) + 1, mark: kept},
	}
	if deferral.IsValid() && deferral.IsSampled() {
		e.Data.deferral = &deferral
	}
	w.mu.Lock()
	if w.clients[client] != stopped {
		// A client not watched yet, or started again since.
		w.clients[client] = stopped
		go w.watchClient(client, stopped)
	}
	replaced, evicted := w.set.Add(e)
	w.size.Store(int64(w.set.Len()))
	if !w.running {
		w.running = true
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
	w.poke()
}

func (w *waker) poke() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// forget drops job: it is running here again.
func (w *waker) forget(ctx context.Context, job *rivertype.JobRow) {
	if w.size.Load() == 0 {
		return
	}
	client, err := river.ClientFromContextSafely[pgx.Tx](ctx)
	if err != nil {
		return
	}
	w.mu.Lock()
	gone := w.set.Forget(jobKey{client: client, id: job.ID})
	w.size.Store(int64(w.set.Len()))
	w.mu.Unlock()
	if gone {
		w.met.remembered.Add(ctx, -1, w.met.system)
	}
}

// watchClient forgets the jobs of client once the run whose Stopped
// channel is stopped ends: a stopped client fetches nothing, and its jobs
// run when their snoozes end (or by another process's fetch).
func (w *waker) watchClient(client *riverClient, stopped <-chan struct{}) {
	<-stopped
	w.mu.Lock()
	if w.clients[client] == stopped {
		delete(w.clients, client)
	}
	n := int64(w.set.RemoveFunc(func(e *wakeEntry) bool { return e.Key.client == client }))
	w.size.Store(int64(w.set.Len()))
	w.mu.Unlock()
	if n > 0 {
		ctx := context.Background()
		w.met.remembered.Add(ctx, -n, w.met.system)
		w.met.dropped.Add(ctx, n, w.met.stopped)
	}
	w.poke()
}

// run looks at the set on every new snapshot, new entry and retry or
// expiry time, until the set is empty. While any job waits it makes the
// tracker poll the replicas of the databases the jobs wait on every
// WaitPollInterval (consume.Router.Watch), as a job waiting in Route
// does: the wake follows the catch-up within milliseconds, and the load on
// a replica stays bounded per process.
func (w *waker) run() {
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
		if w.set.Len() == 0 {
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
			w.wakeAll(due)
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
		}
		timer.Stop()
	}
}

// wakeAll wakes the due jobs, wakeBatch of one client per statement,
// wakeStatements at a time.
func (w *waker) wakeAll(due []*wakeEntry) {
	byClient := map[*riverClient][]*wakeEntry{}
	for _, e := range due {
		byClient[e.Key.client] = append(byClient[e.Key.client], e)
	}
	sem := make(chan struct{}, wakeStatements)
	var wg sync.WaitGroup
	defer wg.Wait()
	for client, es := range byClient {
		for len(es) > 0 {
			batch := es[:min(len(es), wakeBatch)]
			es = es[len(batch):]
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				ctx, cancel := context.WithTimeout(context.Background(), wakeTimeout)
				defer cancel()
				ctx, span := w.startWake(ctx, batch)
				res, err := wakeBatchOf(ctx, client, batch)
				w.transition(err)
				woken := 0
				for i, e := range batch {
					r := wakeResult{err: wakeDatabase, retry: true}
					if err == nil {
						r = res[i]
					}
					w.finish(e, r)
					if r.woken {
						woken++
					}
				}
				span.SetAttributes(attribute.Int(attrWoken, woken))
				span.End()
			})
		}
	}
}

// transition logs a change between wake statements that fail and wake
// statements that succeed, once per change rather than per job.
func (w *waker) transition(err error) {
	w.mu.Lock()
	was := w.failing
	w.failing = err != nil
	w.mu.Unlock()
	switch {
	case err != nil && !was:
		w.log.LogAttrs(context.Background(), slog.LevelWarn, "caughtup: could not make snoozed River jobs available once a replica had replayed their tokens; trying again, and they run when their snoozes end anyway",
			slog.String("messaging.system", "river"), slog.Any("error", err))
	case err == nil && was:
		w.log.LogAttrs(context.Background(), slog.LevelInfo, "caughtup: snoozed River jobs are made available at their catch-up again",
			slog.String("messaging.system", "river"))
	}
}

// wakeResult is what a wake found for one job.
type wakeResult struct {
	woken bool
	err   wakeError
	retry bool // the job may still be movable: try again later
}

// finish records a wake and updates the set.
func (w *waker) finish(e *wakeEntry, r wakeResult) {
	ctx := context.Background()
	w.mu.Lock()
	cur := w.set.Current(e)
	switch {
	case !cur:
		// Forgotten (the job came back), replaced (snoozed again) or
		// dropped meanwhile: the set has accounted for it.
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
		return
	}
	w.met.errs.Add(ctx, 1, w.met.errSets[r.err])
}

// startWake starts the caughtup.wake span of one statement's batch,
// linked to the spans of its snoozes that were traced.
func (w *waker) startWake(ctx context.Context, es []*wakeEntry) (context.Context, trace.Span) {
	var links []trace.Link
	for _, e := range es {
		if e.Data.deferral != nil {
			links = append(links, trace.Link{SpanContext: *e.Data.deferral})
		}
	}
	if len(links) == 0 {
		return ctx, tracenoop.Span{} // no snooze of these was in a trace
	}
	return w.tracer.Start(ctx, consume.SpanWake, trace.WithLinks(links...), trace.WithAttributes(
		semconv.MessagingSystemKey.String("river"), attribute.Int(attrBatchCount, len(es))))
}
