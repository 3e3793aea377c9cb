package wake

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/consume/wakeset"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// Router is what a Waker watches: *consume.Router.
type Router interface {
	// Snapshot is the tracker's current state, whose Changed channel
	// wakes the loop.
	Snapshot() *replay.Snapshot
	// Watch speeds up the polling of the replicas of tok's databases
	// until stop is called.
	Watch(tok position.Token) (stop func())
	// Config has the defaults applied: its Now and its bounds decide
	// whether a token is caught up.
	Config() consume.Config
}

var _ Router = (*consume.Router)(nil)

// Mover moves due jobs through an adapter's queue.
type Mover[K comparable, D any] interface {
	// Group names what the job of key may share one Move with (asynq: its
	// queue; River: its client). The value must be comparable.
	Group(key K) any
	// Move makes the jobs of batch (of one Group, at most Config.Batch)
	// runnable now, each only if its queue still holds it in the
	// deferral its entry describes, and returns exactly one Result per
	// entry, in order. ctx carries the batch's consume.SpanWake span and
	// ends after Config.Timeout. The entries are read only.
	Move(ctx context.Context, batch []*wakeset.Entry[K, D]) []Result
}

// Result is what a Move found for one job.
type Result struct {
	// Woken: the job was made runnable.
	Woken bool
	// Err, when not Woken, says why not: an index into
	// Instruments.ErrorTypes, the error.type it is counted under.
	Err int
	// Retry: the job may still become movable (running, its store
	// unreachable): it is handed to the Mover again after the set's
	// backoff (wakeset.RetryMin to wakeset.RetryMax), until its entry
	// expires. Otherwise it is forgotten.
	Retry bool
}

// Instrument names one of a Waker's instruments.
type Instrument struct{ Name, Unit, Description string }

// Instruments are a Waker's instruments, named by the adapter, which
// documents them (docs/metrics.md). Each carries messaging.system
// (Config.System).
type Instruments struct {
	// Woken is the counter of jobs moved (Result.Woken).
	Woken Instrument
	// Errors is the counter of Results that moved nothing, by error.type:
	// ErrorTypes[Result.Err].
	Errors     Instrument
	ErrorTypes []string
	// Dropped is the counter of jobs forgotten before a replica caught
	// up, by the attribute DropReason: "evicted" (the set was full),
	// "expired" (their delay ended first) or the reason given to
	// RemoveFunc.
	Dropped    Instrument
	DropReason string
	// Remembered is the UpDownCounter of the jobs in the set. Not an
	// observable gauge: a middleware has no Close to unregister a
	// callback with, and the sets of several middlewares on one
	// MeterProvider add up.
	Remembered Instrument
}

// Config is a Waker's configuration.
type Config struct {
	// Capacity bounds the jobs remembered: remembering one more forgets
	// the oldest (Dropped, "evicted"). At least 1.
	Capacity int
	// Batch bounds the jobs of one Move.
	// Default: 1.
	Batch int
	// Moves bounds the Moves in flight.
	// Default: 1.
	Moves int
	// Timeout bounds one Move (its ctx).
	// Default: 0, none.
	Timeout time.Duration
	// System is the messaging.system attribute of the instruments and
	// spans ("asynq", "river"); its errors say "caughtup/<System>".
	System string
	// Instruments names the metrics.
	Instruments Instruments
	// WokenAttribute is the wake span's attribute counting the jobs its
	// Move woke ("caughtup.asynq.woken").
	WokenAttribute string
	// SpanAttributes returns the wake span's attributes besides
	// messaging.system and messaging.batch.message_count, from the batch's
	// Group (asynq: the queue).
	// Default: nil, none.
	SpanAttributes func(group any) []attribute.KeyValue
	// Meter makes the instruments: the adapter's, of its ScopeName.
	// Default: nil, a no-op meter.
	Meter metric.Meter
	// Tracer starts the wake spans: the adapter's.
	// Default: nil, a no-op tracer.
	Tracer trace.Tracer
}

func (c Config) withDefaults() Config {
	c.Batch = max(c.Batch, 1)
	c.Moves = max(c.Moves, 1)
	if c.Meter == nil {
		c.Meter = metricnoop.Meter{}
	}
	if c.Tracer == nil {
		c.Tracer = tracenoop.Tracer{}
	}
	return c
}

// metrics are a Waker's synchronous instruments with their attribute sets.
type metrics struct {
	woken      metric.Int64Counter
	errs       metric.Int64Counter
	errSets    []metric.AddOption
	dropped    metric.Int64Counter
	evicted    metric.AddOption
	expired    metric.AddOption
	remembered metric.Int64UpDownCounter
	system     attribute.KeyValue
	systemSet  metric.AddOption
	dropReason string
}

func newMetrics(c *Config) (*metrics, error) {
	in := &c.Instruments
	system := semconv.MessagingSystemKey.String(c.System)
	m := &metrics{system: system, systemSet: metric.WithAttributeSet(attribute.NewSet(system)), dropReason: in.DropReason}
	wrap := func(name string, err error) error {
		return fmt.Errorf("caughtup/%s: creating %s: %w", c.System, name, err)
	}
	counter := func(i Instrument) (metric.Int64Counter, error) {
		ctr, err := c.Meter.Int64Counter(i.Name, metric.WithUnit(i.Unit), metric.WithDescription(i.Description))
		if err != nil {
			return nil, wrap(i.Name, err)
		}
		return ctr, nil
	}
	var err error
	if m.woken, err = counter(in.Woken); err != nil {
		return nil, err
	}
	if m.errs, err = counter(in.Errors); err != nil {
		return nil, err
	}
	for _, t := range in.ErrorTypes {
		m.errSets = append(m.errSets, metric.WithAttributeSet(attribute.NewSet(system, semconv.ErrorTypeKey.String(t))))
	}
	if m.dropped, err = counter(in.Dropped); err != nil {
		return nil, err
	}
	m.evicted, m.expired = m.dropSet("evicted"), m.dropSet("expired")
	r := in.Remembered
	if m.remembered, err = c.Meter.Int64UpDownCounter(r.Name, metric.WithUnit(r.Unit), metric.WithDescription(r.Description)); err != nil {
		return nil, wrap(r.Name, err)
	}
	return m, nil
}

func (m *metrics) dropSet(reason string) metric.AddOption {
	return metric.WithAttributeSet(attribute.NewSet(m.system, attribute.String(m.dropReason, reason)))
}

// forgot counts n jobs leaving the set before their wake, for reason.
func (m *metrics) forgot(ctx context.Context, n int, reason metric.AddOption) {
	m.remembered.Add(ctx, -int64(n), m.systemSet)
	m.dropped.Add(ctx, int64(n), reason)
}

// Waker remembers an adapter's deferred jobs (keyed by K, with what the
// Mover needs in D) and moves each as soon as a replica has replayed its
// token; see the package documentation.
type Waker[K comparable, D any] struct {
	router Router
	rcfg   consume.Config
	mover  Mover[K, D]
	cfg    Config
	met    *metrics

	size atomic.Int64 // set.Len(), read without the lock on every job

	mu      sync.Mutex
	set     *wakeset.Set[K, D]
	running bool
	closed  bool
	kick    chan struct{}
	done    chan struct{}
	wg      sync.WaitGroup
}

// New returns a Waker that watches router and moves jobs with mover. It
// starts no goroutine until the first Remember.
func New[K comparable, D any](router Router, mover Mover[K, D], cfg Config) (*Waker[K, D], error) {
	cfg = cfg.withDefaults()
	met, err := newMetrics(&cfg)
	if err != nil {
		return nil, err
	}
	return &Waker[K, D]{
		router: router,
		rcfg:   router.Config(),
		mover:  mover,
		cfg:    cfg,
		met:    met,
		set:    wakeset.New[K, D](cfg.Capacity),
		kick:   make(chan struct{}, 1),
		done:   make(chan struct{}),
	}, nil
}

// Len is the number of jobs remembered, read without a lock: a caller
// that finds none skips looking up the key it would Forget.
func (w *Waker[K, D]) Len() int { return int(w.size.Load()) }

// Remember notes that the job e.Key is being deferred until e.Token is
// caught up, at the latest until e.Expires, in place of an earlier
// deferral of the same job; deferral is the deferral's span, which the
// wake's links to when it was sampled. It reports whether e was
// remembered: not with a zero token, which never catches up, nor after
// Close.
func (w *Waker[K, D]) Remember(ctx context.Context, e *wakeset.Entry[K, D], deferral trace.SpanContext) bool {
	if e.Token.IsZero() {
		return false
	}
	if deferral.IsValid() && deferral.IsSampled() {
		e.Deferral = &deferral
	}
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return false
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
		w.met.remembered.Add(ctx, 1-int64(evicted), w.met.systemSet)
	} else if evicted > 0 {
		w.met.remembered.Add(ctx, -int64(evicted), w.met.systemSet)
	}
	if evicted > 0 {
		w.met.dropped.Add(ctx, int64(evicted), w.met.evicted)
	}
	w.poke()
	return true
}

func (w *Waker[K, D]) poke() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Forget drops the job key: it is running again.
func (w *Waker[K, D]) Forget(ctx context.Context, key K) {
	if w.size.Load() == 0 {
		return
	}
	w.mu.Lock()
	gone := w.set.Forget(key)
	w.size.Store(int64(w.set.Len()))
	w.mu.Unlock()
	if gone {
		w.met.remembered.Add(ctx, -1, w.met.systemSet)
	}
}

// RemoveFunc forgets every job for which drop returns true, counted as
// Dropped for reason, and returns how many. It visits every entry: for
// rare events, such as River's client stopping.
func (w *Waker[K, D]) RemoveFunc(reason string, drop func(*wakeset.Entry[K, D]) bool) int {
	w.mu.Lock()
	n := w.set.RemoveFunc(drop)
	w.size.Store(int64(w.set.Len()))
	w.mu.Unlock()
	if n > 0 {
		w.met.forgot(context.Background(), n, w.met.dropSet(reason))
	}
	w.poke()
	return n
}

// Close stops the goroutine, once the Moves in flight have returned, and
// forgets every job: they run when their delays end. Remember does
// nothing after it.
func (w *Waker[K, D]) Close() {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	w.closed = true
	n := w.set.Len()
	w.set = wakeset.New[K, D](w.set.Capacity())
	w.size.Store(0)
	close(w.done)
	w.mu.Unlock()
	w.wg.Wait()
	if n > 0 {
		w.met.remembered.Add(context.Background(), -int64(n), w.met.systemSet)
	}
}

// run looks at the set on every new snapshot, new entry and retry or
// expiry time, until the set is empty or the waker is closed.
func (w *Waker[K, D]) run() {
	defer w.wg.Done()
	stopWatch := func() {}
	defer func() { stopWatch() }()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var (
		due []*wakeset.Entry[K, D]
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
			w.met.forgot(ctx, expired, w.met.expired)
		}
		// Watch again each round (the replicas that answer change); the
		// new watch starts before the old one ends, so the pace holds.
		nextWatch := w.router.Watch(watched)
		stopWatch()
		stopWatch = nextWatch

		if len(due) > 0 {
			w.moveAll(due)
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

// moveAll hands the due jobs to the Mover, Batch of one Group per Move,
// Moves at a time, and starts no more once the waker is closed (Close
// forgets them all).
func (w *Waker[K, D]) moveAll(due []*wakeset.Entry[K, D]) {
	groups := map[any][]*wakeset.Entry[K, D]{}
	for _, e := range due {
		g := w.mover.Group(e.Key)
		groups[g] = append(groups[g], e)
	}
	sem := make(chan struct{}, w.cfg.Moves)
	var wg sync.WaitGroup
	defer wg.Wait()
	for g, es := range groups {
		for len(es) > 0 {
			batch := es[:min(len(es), w.cfg.Batch)]
			es = es[len(batch):]
			select {
			case sem <- struct{}{}:
			case <-w.done:
				return
			}
			wg.Go(func() {
				defer func() { <-sem }()
				w.move(g, batch)
			})
		}
	}
}

// move runs one Move in its span and records its results.
func (w *Waker[K, D]) move(group any, batch []*wakeset.Entry[K, D]) {
	ctx := context.Background()
	if w.cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, w.cfg.Timeout)
		defer cancel()
	}
	ctx, span := w.startWake(ctx, group, batch)
	woken := 0
	for i, r := range w.mover.Move(ctx, batch) {
		w.finish(batch[i], r)
		if r.Woken {
			woken++
		}
	}
	span.SetAttributes(attribute.Int(w.cfg.WokenAttribute, woken))
	span.End()
}

// finish records one job's Result and updates the set.
func (w *Waker[K, D]) finish(e *wakeset.Entry[K, D], r Result) {
	ctx := context.Background()
	w.mu.Lock()
	cur := w.set.Current(e)
	switch {
	case !cur:
		// Forgotten (the job came back), replaced (deferred again) or
		// dropped meanwhile: the set has already accounted for it.
	case r.Retry:
		w.set.RetryAfter(e, time.Now())
	default:
		w.set.Remove(e)
		w.size.Store(int64(w.set.Len()))
	}
	w.mu.Unlock()
	if cur && !r.Retry {
		w.met.remembered.Add(ctx, -1, w.met.systemSet)
	}
	if r.Woken {
		w.met.woken.Add(ctx, 1, w.met.systemSet)
		return
	}
	w.met.errs.Add(ctx, 1, w.met.errSets[r.Err])
}

// startWake starts the consume.SpanWake span of one Move, linked to the
// spans of its jobs' deferrals that were sampled; none when there are
// none.
func (w *Waker[K, D]) startWake(ctx context.Context, group any, batch []*wakeset.Entry[K, D]) (context.Context, trace.Span) {
	var links []trace.Link
	for _, e := range batch {
		if e.Deferral != nil {
			links = append(links, trace.Link{SpanContext: *e.Deferral})
		}
	}
	if len(links) == 0 {
		return ctx, tracenoop.Span{} // no deferral of these was in a trace
	}
	attrs := []attribute.KeyValue{w.met.system}
	if w.cfg.SpanAttributes != nil {
		attrs = append(attrs, w.cfg.SpanAttributes(group)...)
	}
	attrs = append(attrs, semconv.MessagingBatchMessageCount(len(batch)))
	return w.cfg.Tracer.Start(ctx, consume.SpanWake, trace.WithLinks(links...), trace.WithAttributes(attrs...))
}
