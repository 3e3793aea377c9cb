package outbox

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/replicatest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{}),
		// pgtest's signal handler lives as long as the process.
		goleak.IgnoreTopFunction("os/signal.signal_recv"),
		goleak.IgnoreTopFunction("os/signal.loop"),
	)
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// env is one test's database on the shared cluster.
type env struct {
	*replicatest.DB
	capturer *enqueue.Capturer
}

func setup(t *testing.T) *env { return setupTB(t) }

func setupTB(t testing.TB) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e := &env{DB: replicatest.New(t), capturer: enqueue.NewCapturer(enqueue.Config{Database: "main"})}
	require.NoError(t, Migrate(ctx, e.Primary))
	_, err := e.Primary.Exec(ctx, "CREATE TABLE orders (id bigint PRIMARY KEY, note text NOT NULL)")
	require.NoError(t, err)
	return e
}

// writeOrder commits an order row and its outbox event in one transaction
// and returns the event ID and the insert LSN read right after COMMIT on
// the same connection (an upper bound of the commit's end).
func (e *env) writeOrder(ctx context.Context, id int64) (string, position.LSN, error) {
	conn, err := e.Primary.Acquire(ctx)
	if err != nil {
		return "", 0, err
	}
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return "", 0, err
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, "INSERT INTO orders (id, note) VALUES ($1, 'n')", id); err != nil {
		return "", 0, err
	}
	key := strconv.FormatInt(id, 10)
	evID, err := Insert(ctx, tx, Event{Topic: "orders", Key: []byte(key), Payload: []byte(key), Headers: map[string]string{"order": key}})
	if err != nil {
		return "", 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return "", 0, err
	}
	var after string
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&after); err != nil {
		return "", 0, err
	}
	return evID, position.MustParseLSN(after), nil
}

func (e *env) writeOrders(t *testing.T, ctx context.Context, from, n int64) []string {
	t.Helper()
	ids := make([]string, 0, n)
	for i := from; i < from+n; i++ {
		id, _, err := e.writeOrder(ctx, i)
		require.NoError(t, err)
		ids = append(ids, id)
	}
	return ids
}

// replayed reads what the replica has replayed, with its epoch.
func (e *env) replayed(ctx context.Context, conn *pgx.Conn) (position.Replayed, error) {
	tok, err := e.capturer.ReplicaRead(ctx, conn)
	if err != nil {
		return position.Replayed{}, err
	}
	entry, _ := tok.Entry("main")
	return position.Replayed{Epoch: entry.Epoch, LSN: entry.LSN}, nil
}

// readResult is how a consumer that checks tokens before reading fared.
type readResult struct {
	replica, primary, stale int
}

// consumeCheck is the consumer under test: compare the event's token with
// the replica's replay position, and read the order on the replica only if
// the replica has caught up; a missing row there is a stale read.
func (e *env) consumeCheck(ctx context.Context, ev Event) (onReplica, stale bool, err error) {
	tok, err := TokenFromHeaders(ev.Headers)
	if err != nil {
		return false, false, err
	}
	entry, ok := tok.Entry("main")
	if !ok {
		return false, false, fmt.Errorf("event %s has no token entry for main: %v", ev.ID, ev.Headers)
	}
	conn, err := e.Replica.Acquire(ctx)
	if err != nil {
		return false, false, err
	}
	defer conn.Release()
	r, err := e.replayed(ctx, conn.Conn())
	if err != nil {
		return false, false, err
	}
	if entry.Compare(r, nil).Status != position.CaughtUp {
		return false, false, nil
	}
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM orders WHERE id = $1", ev.Key).Scan(&n); err != nil {
		return true, false, err
	}
	return true, n == 0, nil
}

// memPublisher records every published event; fail, when set, runs first
// and can refuse a batch. It is the broker of these tests: the relays'
// faults come from fault.Publisher wrapped around it.
type memPublisher struct {
	mu      sync.Mutex
	events  []Event
	calls   int
	fail    func(call int, events []Event) error
	changed chan struct{} // closed and replaced on every publish
}

func newMemPublisher() *memPublisher { return &memPublisher{changed: make(chan struct{})} }

func (p *memPublisher) Publish(ctx context.Context, events []Event) error {
	p.mu.Lock()
	p.calls++
	call, fail := p.calls, p.fail
	p.mu.Unlock()
	if fail != nil {
		if err := fail(call, events); err != nil {
			return err
		}
	}
	p.mu.Lock()
	p.events = append(p.events, events...)
	close(p.changed)
	p.changed = make(chan struct{})
	p.mu.Unlock()
	return nil
}

func (p *memPublisher) setFail(f func(call int, events []Event) error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fail = f
}

func (p *memPublisher) snapshot() []Event {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.events)
}

// next returns the events published so far and a channel closed at the
// next publish: a reader that checks the first and then waits on the
// second cannot miss one.
func (p *memPublisher) next() ([]Event, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.events), p.changed
}

// wait blocks until cond holds for the published events or ctx ends.
func (p *memPublisher) wait(ctx context.Context, cond func(events []Event) bool) error {
	for {
		events, changed := p.next()
		if cond(events) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
		}
	}
}

// byID groups events by event ID.
func byID(events []Event) map[string][]Event {
	out := map[string][]Event{}
	for _, ev := range events {
		out[ev.ID] = append(out[ev.ID], ev)
	}
	return out
}

// byID groups the published events by event ID.
func (p *memPublisher) byID() map[string][]Event { return byID(p.snapshot()) }

// waitFor waits until every id has been published at least n times
// (once when n is omitted).
func (p *memPublisher) waitFor(t testing.TB, ctx context.Context, ids []string, n ...int) map[string][]Event {
	t.Helper()
	want := 1
	if len(n) > 0 {
		want = n[0]
	}
	var got map[string][]Event
	missing := 0
	err := p.wait(ctx, func(events []Event) bool {
		got = byID(events)
		missing = 0
		for _, id := range ids {
			if len(got[id]) < want {
				missing++
			}
		}
		return missing == 0
	})
	if err != nil {
		t.Fatalf("%d of %d events not published %d times: %v", missing, len(ids), want, err)
	}
	return got
}

func eventIDs(events []Event) []string {
	ids := make([]string, len(events))
	for i, ev := range events {
		ids[i] = ev.ID
	}
	return ids
}

// runInBackground runs f until the test ends (or cancel is called) and
// waits for it to return.
func runInBackground(t testing.TB, ctx context.Context, f func(ctx context.Context) error) (cancel func()) {
	ctx, cancelCtx := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f(ctx) }()
	var once sync.Once
	cancel = func() {
		once.Do(func() {
			cancelCtx()
			if err := <-done; err != nil {
				t.Errorf("background run: %v", err)
			}
		})
	}
	t.Cleanup(cancel)
	return cancel
}

func tokenLSN(t *testing.T, ev Event) position.LSN {
	t.Helper()
	tok, err := TokenFromHeaders(ev.Headers)
	require.NoError(t, err)
	e, ok := tok.Entry("main")
	require.True(t, ok, "no token entry in %v", ev.Headers)
	return e.LSN
}
