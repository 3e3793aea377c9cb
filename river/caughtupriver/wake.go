package caughtupriver

import (
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/consume/wake"
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

const (
	attrWakeDrop = "caughtup.river.wake.reason"
	attrWoken    = "caughtup.river.woken"
)

// wakeInstruments are the waker's metrics (see wake.Instruments), named
// as asynq's (caughtup.asynq.wake.*).
var wakeInstruments = wake.Instruments{
	Woken: wake.Instrument{Name: "caughtup.river.wake.jobs", Unit: "{job}",
		Description: "Snoozed River jobs made available as soon as a replica had replayed their token, instead of when their snooze ended."},
	Errors: wake.Instrument{Name: "caughtup.river.wake.errors", Unit: "{attempt}",
		Description: "Attempts to wake a snoozed River job that did not make it available, by error.type (not_found, running, available, finished, changed, database); the job runs when its snooze ends, or already ran."},
	ErrorTypes: wakeErrorNames[:],
	Dropped: wake.Instrument{Name: "caughtup.river.wake.dropped", Unit: "{job}",
		Description: "Snoozed River jobs forgotten before a replica caught up, by caughtup.river.wake.reason: evicted (the set was full; raise Config.WakeCapacity), expired (their snooze ended first) or stopped (their client stopped)."},
	DropReason: attrWakeDrop,
	Remembered: wake.Instrument{Name: "caughtup.river.wake.remembered", Unit: "{job}",
		Description: "Snoozed River jobs the process remembers, to make them available as soon as a replica has replayed their token (bounded by Config.WakeCapacity)."},
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
// this one's.
type wakeJob struct {
	// attempt is the row's attempt once River has written the snooze: the
	// fetched attempt minus one (a snooze gives the attempt back).
	attempt int
	// snoozes is the row's metadata "snoozes" once River has written the
	// snooze: one more than the fetched job's.
	snoozes int64
	// mark: the snooze kept the position the job was routed by
	// (keepSnoozed), so the wake writes wokenKey for snoozedToken.
	mark bool
}

type wakeEntry = wakeset.Entry[jobKey, wakeJob]

// waker makes snoozed jobs available as soon as a replica has replayed
// their token. The middleware remembers each snooze (remember) and
// forgets a job that comes back to it (forget); the loop is wake.Waker's,
// which hands the jobs whose token is caught up to Move (the waker is its
// wake.Mover), up to wakeBatch per statement (wakeSQL), through the job's
// own River client's driver.
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
	*wake.Waker[jobKey, wakeJob]
	log     *slog.Logger
	failing atomic.Bool // the last wake statement failed (logged once per change)

	mu      sync.Mutex
	clients map[*riverClient]<-chan struct{} // those watched, to their run's Stopped
}

var _ wake.Mover[jobKey, wakeJob] = (*waker)(nil)

func newWaker(router *consume.Router, capacity int, mp metric.MeterProvider, tracer trace.Tracer, log *slog.Logger) (*waker, error) {
	w := &waker{log: log, clients: make(map[*riverClient]<-chan struct{})}
	var err error
	w.Waker, err = wake.New[jobKey, wakeJob](router, w, wake.Config{
		Capacity: capacity, Batch: wakeBatch, Moves: wakeStatements, Timeout: wakeTimeout,
		System: "river", Instruments: wakeInstruments, WokenAttribute: attrWoken,
		Meter: mp.Meter(ScopeName), Tracer: tracer,
	})
	if err != nil {
		return nil, err
	}
	return w, nil
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
	if !w.Remember(ctx, e, deferral) {
		return
	}
	// Watched after the Add: a client that stopped in between is watched
	// anew, and its watch forgets the job.
	w.mu.Lock()
	if w.clients[client] != stopped {
		// A client not watched yet, or started again since.
		w.clients[client] = stopped
		go w.watchClient(client, stopped)
	}
	w.mu.Unlock()
}

// forget drops job: it is running here again.
func (w *waker) forget(ctx context.Context, job *rivertype.JobRow) {
	if w.Len() == 0 {
		return
	}
	if client, err := river.ClientFromContextSafely[pgx.Tx](ctx); err == nil {
		w.Forget(ctx, jobKey{client: client, id: job.ID})
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
	w.mu.Unlock()
	w.RemoveFunc("stopped", func(e *wakeEntry) bool { return e.Key.client == client })
}

// Group is the job's client: one statement wakes jobs of one database and
// schema, through that client's driver.
func (w *waker) Group(k jobKey) any { return k.client }

// Move wakes batch, jobs of one client, with one wake statement.
func (w *waker) Move(ctx context.Context, batch []*wakeEntry) []wake.Result {
	res, err := wakeBatchOf(ctx, batch[0].Key.client, batch)
	w.transition(err)
	out := make([]wake.Result, len(batch))
	for i := range batch {
		r := wakeResult{err: wakeDatabase, retry: true}
		if err == nil {
			r = res[i]
		}
		out[i] = wake.Result{Woken: r.woken, Err: int(r.err), Retry: r.retry}
	}
	return out
}

// transition logs a change between wake statements that fail and wake
// statements that succeed, once per change rather than per job.
func (w *waker) transition(err error) {
	switch was := w.failing.Swap(err != nil); {
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
