package wake_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/consume/wake"
	"github.com/caughtup/caughtup/consume/wakeset"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/spantest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	t0    = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	epoch = position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}
)

// A job of the tests: its queue is its Group.
type job struct {
	queue string
	id    int
}

type entry = wakeset.Entry[job, string]

// Error types of the tests' mover, by Result.Err.
const (
	errBusy = iota
	errGone
)

// router is a fixed snapshot source: one replica of "main", fresh at t0
// (its clock), that has replayed replayed; Snapshot.Changed never fires,
// as for any snapshot no tracker published. It counts the watches not
// stopped yet.
type router struct {
	replayed atomic.Int64
	watching atomic.Int64
	mu       sync.Mutex
	watched  []position.Entry // the last Watch's databases
}

func newRouter(lsn position.LSN) *router {
	r := &router{}
	r.replayed.Store(int64(lsn))
	return r
}

func (r *router) Snapshot() *replay.Snapshot {
	return &replay.Snapshot{Databases: []replay.DatabaseState{{
		Name:    "main",
		Primary: replay.PrimaryState{Epoch: epoch, HistoryKnown: true, InsertLSN: 1 << 40, ObservedAt: t0},
		Replicas: []replay.ReplicaState{{
			Name: "r1", Replayed: position.Replayed{Epoch: epoch, LSN: position.LSN(r.replayed.Load())},
			InRecovery: true, Healthy: true, ObservedAt: t0, Observations: 1,
		}},
	}}}
}

func (r *router) Watch(tok position.Token) func() {
	r.mu.Lock()
	r.watched = append([]position.Entry(nil), tok.Entries...)
	r.mu.Unlock()
	r.watching.Add(1)
	var once sync.Once
	return func() { once.Do(func() { r.watching.Add(-1) }) }
}

func (r *router) lastWatched() []position.Entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.watched
}

func (r *router) Config() consume.Config {
	return consume.Config{Now: func() time.Time { return t0 }}.WithDefaults()
}

// mover records every Move and answers by its result function (Woken
// when nil); a job whose id is in hold waits in Move until the channel
// is closed.
type mover struct {
	result func(e *entry, call int) wake.Result
	hold   map[int]chan struct{}

	mu       sync.Mutex
	batches  [][]job
	calls    map[job]int
	inFlight int
	maxIn    int
}

func (m *mover) Group(k job) any { return k.queue }

func (m *mover) Move(ctx context.Context, batch []*entry) []wake.Result {
	m.mu.Lock()
	m.inFlight++
	m.maxIn = max(m.maxIn, m.inFlight)
	var keys []job
	for _, e := range batch {
		keys = append(keys, e.Key)
	}
	m.batches = append(m.batches, keys)
	m.mu.Unlock()
	for _, e := range batch {
		if ch := m.hold[e.Key.id]; ch != nil {
			<-ch
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.inFlight--
	if m.calls == nil {
		m.calls = map[job]int{}
	}
	out := make([]wake.Result, len(batch))
	for i, e := range batch {
		m.calls[e.Key]++
		out[i] = wake.Result{Woken: true}
		if m.result != nil {
			out[i] = m.result(e, m.calls[e.Key])
		}
	}
	return out
}

func (m *mover) moved() (batches [][]job, calls map[job]int, maxIn int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	calls = map[job]int{}
	for k, n := range m.calls {
		calls[k] = n
	}
	return append([][]job(nil), m.batches...), calls, m.maxIn
}

var instruments = wake.Instruments{
	Woken:      wake.Instrument{Name: "test.wake.jobs", Unit: "{job}", Description: "woken"},
	Errors:     wake.Instrument{Name: "test.wake.errors", Unit: "{attempt}", Description: "errors"},
	ErrorTypes: []string{errBusy: "busy", errGone: "gone"},
	Dropped:    wake.Instrument{Name: "test.wake.dropped", Unit: "{job}", Description: "dropped"},
	DropReason: "test.wake.reason",
	Remembered: wake.Instrument{Name: "test.wake.remembered", Unit: "{job}", Description: "remembered"},
}

type fixture struct {
	w      *wake.Waker[job, string]
	router *router
	mover  *mover
	reader *sdkmetric.ManualReader
}

// setup starts a waker on r and m with cfg's Batch, Moves, Timeout,
// Capacity (10 if 0), Tracer and SpanAttributes; the waker is closed when
// the test ends.
func setup(t *testing.T, r *router, m *mover, cfg wake.Config) *fixture {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	if cfg.Capacity == 0 {
		cfg.Capacity = 10
	}
	cfg.System, cfg.Instruments, cfg.WokenAttribute = "test", instruments, "test.woken"
	cfg.Meter = mp.Meter("test")
	w, err := wake.New[job, string](r, m, cfg)
	require.NoError(t, err)
	t.Cleanup(w.Close)
	return &fixture{w: w, router: r, mover: m, reader: reader}
}

func (f *fixture) sum(t *testing.T, name string, want ...attribute.KeyValue) int64 {
	t.Helper()
	return metrictest.Sum(t, f.reader, name, want...)
}

func (f *fixture) remembered(t *testing.T) int64 { return f.sum(t, "test.wake.remembered") }

func (f *fixture) dropped(t *testing.T, reason string) int64 {
	return f.sum(t, "test.wake.dropped", attribute.String("test.wake.reason", reason))
}

func (f *fixture) errors(t *testing.T, typ string) int64 {
	return f.sum(t, "test.wake.errors", attribute.String("error.type", typ))
}

// remember remembers job k waiting for LSN lsn of "main", for an hour.
func (f *fixture) remember(t *testing.T, k job, lsn position.LSN) *entry {
	t.Helper()
	e := &entry{Key: k, Token: tokenAt(lsn), Expires: time.Now().Add(time.Hour)}
	require.True(t, f.w.Remember(context.Background(), e, trace.SpanContext{}))
	return e
}

func tokenAt(lsn position.LSN) position.Token {
	return position.New("main", epoch, lsn, position.SourcePrimary, t0)
}

func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	require.Eventually(t, cond, 30*time.Second, 5*time.Millisecond, msg)
}

// The jobs whose token is caught up are handed to the Mover, in batches
// of at most Batch jobs of one Group, no more than Moves at once, each
// once, and forgotten; a job still behind stays, its database watched.
func TestWakeMovesCaughtUpJobs(t *testing.T) {
	t.Parallel()
	f := setup(t, newRouter(500), &mover{}, wake.Config{Batch: 2, Moves: 1})
	due := []job{{"a", 1}, {"a", 2}, {"a", 3}, {"b", 4}}
	for _, k := range due {
		f.remember(t, k, 100)
	}
	f.remember(t, job{"a", 5}, 1000)
	eventually(t, func() bool { return f.sum(t, "test.wake.jobs") == 4 }, "the caught-up jobs were not woken")
	require.Equal(t, int64(1), f.remembered(t), "the job still behind")
	require.Equal(t, 1, f.w.Len())
	batches, calls, maxIn := f.mover.moved()
	require.Len(t, calls, len(due))
	for _, k := range due {
		require.Equal(t, 1, calls[k], "job %v moved once", k)
	}
	for _, b := range batches {
		require.LessOrEqual(t, len(b), 2, "Batch")
		for _, k := range b {
			require.Equal(t, b[0].queue, k.queue, "one Group per Move: %v", b)
		}
	}
	require.Equal(t, 1, maxIn, "Moves")
	eventually(t, func() bool {
		w := f.router.lastWatched()
		return len(w) == 1 && w[0] == position.Entry{Database: "main"} && f.router.watching.Load() == 1
	}, "the database of the job behind is not watched, once")
	require.Zero(t, f.errors(t, "busy")+f.errors(t, "gone"))

	f.w.Close()
	require.Zero(t, f.remembered(t), "Close forgets the job behind")
	require.Zero(t, f.dropped(t, "evicted")+f.dropped(t, "expired"), "which is not counted as dropped")
	require.Zero(t, f.router.watching.Load(), "and stops watching")
	require.False(t, f.w.Remember(context.Background(), &entry{Key: job{"a", 6}, Token: tokenAt(1)}, trace.SpanContext{}), "nothing is remembered after Close")
	require.Zero(t, f.w.Len())
	f.w.Close() // again: nothing
}

// A job the Mover cannot move yet is handed to it again after the set's
// backoff, counted under its error type each time; one it finds gone is
// forgotten at once. Once the set is empty the loop ends, and so does its
// watch.
func TestWakeRetriesUntilMoved(t *testing.T) {
	t.Parallel()
	m := &mover{result: func(e *entry, call int) wake.Result {
		switch {
		case e.Key.id == 2:
			return wake.Result{Err: errGone}
		case call <= 3:
			return wake.Result{Err: errBusy, Retry: true}
		}
		return wake.Result{Woken: true}
	}}
	f := setup(t, newRouter(500), m, wake.Config{Batch: 10, Moves: 2})
	f.remember(t, job{"a", 1}, 100)
	f.remember(t, job{"a", 2}, 100)
	eventually(t, func() bool { return f.sum(t, "test.wake.jobs") == 1 && f.errors(t, "gone") == 1 }, "not moved")
	eventually(t, func() bool { return f.router.watching.Load() == 0 }, "the loop did not stop watching once the set was empty")
	_, calls, _ := m.moved()
	require.Equal(t, map[job]int{{"a", 1}: 4, {"a", 2}: 1}, calls)
	require.Equal(t, int64(3), f.errors(t, "busy"))
	require.Zero(t, f.remembered(t))
	require.Zero(t, f.w.Len())

	// The loop starts again with the next job.
	f.remember(t, job{"b", 3}, 100)
	eventually(t, func() bool { return f.sum(t, "test.wake.jobs") == 2 }, "a job remembered after the loop ended was not moved")
}

// A job forgotten (it came back) or deferred again while its Move is in
// flight is not counted again when the Move returns, and the new deferral
// is left alone.
func TestWakeForgottenInFlight(t *testing.T) {
	t.Parallel()
	release1, release2 := make(chan struct{}), make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(release1); close(release2) }) }
	m := &mover{
		hold: map[int]chan struct{}{1: release1, 2: release2},
		result: func(e *entry, _ int) wake.Result {
			if e.Key.id == 2 {
				return wake.Result{Err: errBusy, Retry: true}
			}
			return wake.Result{Woken: true}
		},
	}
	f := setup(t, newRouter(500), m, wake.Config{Moves: 2})
	t.Cleanup(release) // before Close, which waits for the Moves
	// Behind until both are remembered, so that one scan finds both (the
	// loop scans again only once a round's Moves have all returned).
	f.remember(t, job{"a", 1}, 1000)
	f.remember(t, job{"b", 2}, 1000)
	f.router.replayed.Store(2000)
	f.remember(t, job{"c", 3}, 5000) // wakes the loop; stays behind
	eventually(t, func() bool { b, _, _ := m.moved(); return len(b) == 2 }, "the Moves did not start")

	f.w.Forget(context.Background(), job{"a", 1})
	require.Equal(t, int64(2), f.remembered(t))
	again := f.remember(t, job{"b", 2}, 3000) // deferred again, behind
	require.Equal(t, int64(2), f.remembered(t), "replaced, not added")
	release()
	eventually(t, func() bool { return f.sum(t, "test.wake.jobs") == 1 && f.errors(t, "busy") == 1 }, "the Moves did not return")
	require.Equal(t, int64(2), f.remembered(t), "the forgotten job is not counted twice")
	require.Equal(t, 2, f.w.Len())
	require.Zero(t, again.Tries(), "the new deferral is not put back for a retry")
	_, calls, _ := m.moved()
	require.Equal(t, map[job]int{{"a", 1}: 1, {"b", 2}: 1}, calls, "the new deferral waits for its own token")
}

// A job whose own delay has ended first is forgotten as expired, at once
// or when the loop's timer reaches its expiry, and never moved.
func TestWakeExpires(t *testing.T) {
	t.Parallel()
	f := setup(t, newRouter(500), &mover{}, wake.Config{})
	ctx := context.Background()
	require.True(t, f.w.Remember(ctx, &entry{Key: job{"a", 1}, Token: tokenAt(1000), Expires: time.Now()}, trace.SpanContext{}))
	require.True(t, f.w.Remember(ctx, &entry{Key: job{"a", 2}, Token: tokenAt(1000), Expires: time.Now().Add(50 * time.Millisecond)}, trace.SpanContext{}))
	eventually(t, func() bool { return f.dropped(t, "expired") == 2 }, "not expired")
	require.Zero(t, f.remembered(t))
	require.Zero(t, f.w.Len())
	batches, _, _ := f.mover.moved()
	require.Empty(t, batches)
}

// A full set forgets its oldest job (evicted); a job deferred again
// replaces its entry; RemoveFunc forgets by a predicate, for a reason.
func TestWakeBounds(t *testing.T) {
	t.Parallel()
	f := setup(t, newRouter(500), &mover{}, wake.Config{Capacity: 2})
	old := f.remember(t, job{"a", 1}, 1000)
	f.remember(t, job{"a", 2}, 1000)
	f.remember(t, job{"b", 3}, 1000)
	require.Equal(t, int64(2), f.remembered(t))
	require.Equal(t, int64(1), f.dropped(t, "evicted"))
	f.remember(t, job{"b", 3}, 2000)
	require.Equal(t, int64(2), f.remembered(t), "replaced")
	require.Equal(t, int64(1), f.dropped(t, "evicted"))
	require.Equal(t, 2, f.w.Len())
	f.w.Forget(context.Background(), old.Key)
	require.Equal(t, int64(2), f.remembered(t), "the evicted job is not forgotten twice")

	require.Equal(t, 1, f.w.RemoveFunc("stopped", func(e *entry) bool { return e.Key.queue == "b" }))
	require.Equal(t, int64(1), f.dropped(t, "stopped"))
	require.Equal(t, int64(1), f.remembered(t))
	f.w.Forget(context.Background(), job{"a", 2})
	require.Zero(t, f.remembered(t))
	require.Zero(t, f.w.Len())

	require.False(t, f.w.Remember(context.Background(), &entry{Key: job{"a", 4}, Expires: time.Now().Add(time.Hour)}, trace.SpanContext{}),
		"a zero token never catches up")
	require.Zero(t, f.w.Len())
}

// Remember wakes the loop: a job behind, whose replica has caught up
// since in a snapshot whose Changed never fires, is moved with the next
// job remembered.
func TestWakeRememberWakesTheLoop(t *testing.T) {
	t.Parallel()
	f := setup(t, newRouter(500), &mover{}, wake.Config{})
	f.remember(t, job{"a", 1}, 1000)
	eventually(t, func() bool { return f.router.watching.Load() == 1 }, "the loop did not look")
	f.router.replayed.Store(2000)
	f.remember(t, job{"a", 2}, 1000)
	eventually(t, func() bool { return f.sum(t, "test.wake.jobs") == 2 }, "not moved")
}

// A Move is a consume.SpanWake span linked to the spans of its jobs'
// deferrals that were sampled, with messaging.system, the Mover's
// attributes, the batch's size and how many it woke; a Move none of whose
// deferrals was sampled has none.
func TestWakeSpan(t *testing.T) {
	t.Parallel()
	exp, tp := spantest.New(t)
	m := &mover{result: func(e *entry, _ int) wake.Result {
		if e.Key.id == 2 {
			return wake.Result{Err: errGone}
		}
		return wake.Result{Woken: true}
	}}
	f := setup(t, newRouter(500), m, wake.Config{
		Batch: 10, Tracer: tp.Tracer("test"),
		SpanAttributes: func(g any) []attribute.KeyValue { return []attribute.KeyValue{attribute.String("queue", g.(string))} },
	})
	_, deferral := tp.Tracer("test").Start(context.Background(), "defer")
	deferral.End()
	ctx := context.Background()
	// Behind until all three are remembered: one scan finds them all.
	for _, e := range []struct {
		k        job
		deferral trace.SpanContext
	}{{job{"a", 1}, deferral.SpanContext()}, {job{"a", 2}, trace.SpanContext{}}, {job{"b", 3}, trace.SpanContext{}}} {
		require.True(t, f.w.Remember(ctx, &entry{Key: e.k, Token: tokenAt(1000), Expires: time.Now().Add(time.Hour)}, e.deferral))
	}
	f.router.replayed.Store(2000)
	f.remember(t, job{"b", 4}, 1000) // wakes the loop
	eventually(t, func() bool { return f.sum(t, "test.wake.jobs") == 3 }, "not moved")
	f.w.Close() // the spans have ended
	spans := spantest.Named(exp, consume.SpanWake)
	require.Len(t, spans, 1, "queue b's Move had no sampled deferral")
	s := spans[0]
	require.Len(t, s.Links, 1)
	require.Equal(t, deferral.SpanContext().SpanID(), s.Links[0].SpanContext.SpanID())
	attrs := spantest.Attrs(s)
	require.Equal(t, "test", attrs["messaging.system"].AsString())
	require.Equal(t, "a", attrs["queue"].AsString())
	require.Equal(t, int64(2), attrs["messaging.batch.message_count"].AsInt64())
	require.Equal(t, int64(1), attrs["test.woken"].AsInt64())
}

// Timeout bounds each Move's context; without it the context has no
// deadline.
func TestWakeTimeout(t *testing.T) {
	t.Parallel()
	for _, timeout := range []time.Duration{0, time.Minute} {
		deadlines := make(chan bool, 1)
		m := &moveFunc{func(ctx context.Context, batch []*entry) []wake.Result {
			_, ok := ctx.Deadline()
			deadlines <- ok
			return make([]wake.Result, len(batch))
		}}
		reader := sdkmetric.NewManualReader()
		w, err := wake.New[job, string](newRouter(500), m, wake.Config{Capacity: 1, Timeout: timeout, Instruments: instruments,
			Meter: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("test")})
		require.NoError(t, err)
		require.True(t, w.Remember(context.Background(), &entry{Key: job{"a", 1}, Token: tokenAt(1), Expires: time.Now().Add(time.Hour)}, trace.SpanContext{}))
		require.Equal(t, timeout > 0, <-deadlines)
		w.Close()
	}
}

type moveFunc struct {
	f func(context.Context, []*entry) []wake.Result
}

func (m *moveFunc) Group(k job) any { return k.queue }
func (m *moveFunc) Move(ctx context.Context, batch []*entry) []wake.Result {
	return m.f(ctx, batch)
}
