package caughtupasynq

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
)

// A deferral is the error Middleware returns to defer a task: the router's
// *consume.DeferError (errors.As finds it), marked by ServerConfig's hooks
// when asynq passes it to them. When the task comes back, the marks say
// whether the server had the hooks: asynq calls IsFailure and then
// RetryDelayFunc for every error of an attempt that is not the last.
type deferral struct {
	*consume.DeferError
	seen atomic.Uint32
}

func (d *deferral) Unwrap() error { return d.DeferError }

const (
	seenIsFailure uint32 = 1 << iota
	seenRetryDelay
)

// seen marks the deferral in err, if any, as seen by a hook.
func seen(err error, hook uint32) {
	var d *deferral
	if errors.As(err, &d) {
		d.seen.Or(hook)
	}
}

// maxWatched bounds the deferred tasks a hookWatch remembers. A task that
// another worker process runs next never comes back here; the oldest
// entries make room for new ones.
const maxWatched = 1024

// hookWatch tells a newcomer who wired Middleware without ServerConfig
// that every deferral costs a retry. It remembers the tasks it deferred
// (by queue and id) and judges each when it comes back: if asynq's
// IsFailure never saw the deferral and the retry count grew, the hook is
// missing; if IsFailure saw it but RetryDelayFunc did not, that hook was
// replaced. A task that comes back without either mark and with the same
// retry count was requeued by a shutdown, not judged: no verdict. There is
// no timing in the judgement, only what asynq did.
type hookWatch struct {
	met  *metrics
	log  *slog.Logger
	warn *rate.Sometimes

	pending atomic.Int32 // len(byID), read without the lock on every task
	mu      sync.Mutex
	byID    map[string]watched
	ring    [maxWatched]string // ids in insertion order, for eviction
	seq     uint64
}

type watched struct {
	queue   string
	d       *deferral
	retried int
	seq     uint64
}

func newHookWatch(met *metrics, log *slog.Logger) *hookWatch {
	return &hookWatch{met: met, log: log, warn: &rate.Sometimes{First: 1, Interval: time.Minute}, byID: make(map[string]watched)}
}

// deferred remembers a deferral the middleware is about to return for the
// task ctx belongs to.
func (w *hookWatch) deferred(ctx context.Context, d *deferral) {
	id, ok := asynq.GetTaskID(ctx)
	if !ok {
		return // not run by asynq's server: nothing will come back
	}
	queue, _ := asynq.GetQueueName(ctx)
	retried, _ := asynq.GetRetryCount(ctx)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seq++
	slot := &w.ring[w.seq%maxWatched]
	if old, ok := w.byID[*slot]; ok && old.seq+maxWatched == w.seq {
		delete(w.byID, *slot)
	}
	*slot = id
	w.byID[id] = watched{queue: queue, d: d, retried: retried, seq: w.seq}
	w.pending.Store(int32(len(w.byID)))
}

// arrived judges the task ctx belongs to if the middleware deferred it
// before.
func (w *hookWatch) arrived(ctx context.Context) {
	if w.pending.Load() == 0 {
		return
	}
	id, ok := asynq.GetTaskID(ctx)
	if !ok {
		return
	}
	queue, _ := asynq.GetQueueName(ctx)
	w.mu.Lock()
	e, ok := w.byID[id]
	if ok && e.queue == queue {
		delete(w.byID, id)
		w.pending.Store(int32(len(w.byID)))
	}
	w.mu.Unlock()
	if !ok || e.queue != queue {
		return
	}
	retried, _ := asynq.GetRetryCount(ctx)
	marks := e.d.seen.Load()
	switch {
	case marks&seenIsFailure == 0 && retried > e.retried:
		w.report(ctx, hookIsFailure, queue, retried, e.retried)
	case marks&seenIsFailure != 0 && marks&seenRetryDelay == 0:
		w.report(ctx, hookRetryDelayFunc, queue, retried, e.retried)
	}
}

func (w *hookWatch) report(ctx context.Context, h hook, queue string, retried, before int) {
	w.met.missingHook(ctx, h)
	if !w.log.Enabled(ctx, slog.LevelError) {
		return
	}
	w.warn.Do(func() {
		msg := "caughtup: asynq ran a deferred task again without caughtupasynq.ServerConfig's IsFailure hook, so the deferral cost it a retry; create the server with caughtupasynq.NewServer, or pass its asynq.Config through caughtupasynq.ServerConfig and keep the hooks it sets"
		if h == hookRetryDelayFunc {
			msg = "caughtup: asynq scheduled a deferred task without caughtupasynq.ServerConfig's RetryDelayFunc, so it came back after asynq's retry backoff instead of the router's delay; keep the RetryDelayFunc that ServerConfig sets (it calls yours for other errors)"
		}
		w.log.LogAttrs(ctx, slog.LevelError, msg,
			slog.String("messaging.system", "asynq"),
			slog.String("messaging.destination.name", queue),
			slog.String(attrHook, h.String()),
			slog.Int("caughtup.asynq.retried_before", before),
			slog.Int("caughtup.asynq.retried", retried))
	})
}
