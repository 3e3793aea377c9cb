package outbox

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/latency"
)

// preload commits n events, perTx per transaction, with one multi-row
// INSERT per transaction so that loading is not what is measured.
func (e *env) preload(ctx context.Context, n, perTx int) error {
	for done := 0; done < n; done += perTx {
		k := min(perTx, n-done)
		err := pgx.BeginFunc(ctx, e.Primary, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO outbox (event_id, topic, key, payload, headers)
				SELECT gen_random_uuid()::text, 'bench', convert_to(g::text, 'UTF8'), convert_to(repeat('x', 200), 'UTF8'), '{"h":"v"}'
				FROM generate_series(1, $1) g`, k)
			return err
		})
		if err != nil {
			return err
		}
	}
	return nil
}

func waitCount(ctx context.Context, pub *memPublisher, n int) error {
	got := 0
	err := pub.wait(ctx, func(events []Event) bool { got = len(events); return got >= n })
	if err != nil {
		return fmt.Errorf("%d of %d events published: %w", got, n, err)
	}
	return nil
}

// measureRelay preloads n events and returns how long the relay took to
// publish them all to an in-memory publisher: relay cost only, no broker.
func measureRelay(tb testing.TB, e *env, kind string, n int) time.Duration {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pub := newMemPublisher()
	var run func(context.Context) error
	switch kind {
	case "polling":
		r, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: pub, BatchSize: 500, Logger: quiet})
		require.NoError(tb, err)
		run = r.Run
	case "logical":
		cfg := LogicalConfig{ConnString: e.Cluster.Primary().DSN(e.Database), Slot: uniqueSlot(e.Database), Publisher: pub, MaxBatch: 500, Logger: quiet}
		r, err := NewLogicalRelay(cfg)
		require.NoError(tb, err)
		require.NoError(tb, r.Setup(ctx))
		tb.Cleanup(func() { _ = r.Teardown(context.Background()) })
		run = r.Run
	}
	require.NoError(tb, e.preload(ctx, n, 10))
	began := time.Now()
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- run(rctx) }()
	require.NoError(tb, waitCount(ctx, pub, n))
	took := time.Since(began)
	stop()
	require.NoError(tb, <-done)
	return took
}

// BenchmarkRelay reports events/s for each relay on this machine: 2000
// committed events per iteration, 10 per transaction, 200-byte payloads,
// published to memory, so it measures the relay, not a broker.
func BenchmarkRelay(b *testing.B) {
	for _, kind := range []string{"polling", "logical"} {
		b.Run(kind, func(b *testing.B) {
			e := setupTB(b)
			var total time.Duration
			events := 0
			for b.Loop() {
				total += measureRelay(b, e, kind, 2000)
				events += 2000
			}
			b.ReportMetric(float64(events)/total.Seconds(), "events/s")
		})
	}
}

// overApproximation runs both relays on one table under concurrent
// writers (writers × perWriter orders). The logical relay's token for an
// event is its transaction's exact end LSN; the polling relay's token for
// the same event minus that is how many WAL bytes the polling token asks
// a replica to replay beyond what the event needs. It fails tb if one is
// negative: that would be a polling token below the commit.
func overApproximation(tb testing.TB, writers, perWriter int) []int64 {
	e := setupTB(tb)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	logicalPub, pollingPub := newMemPublisher(), newMemPublisher()
	// The logical relay keeps rows (the polling relay deletes them), and
	// its publication carries inserts only, so neither disturbs the other.
	lr := newLogical(tb, e, LogicalConfig{Publisher: logicalPub, KeepRows: true, FlushDelay: time.Millisecond})
	require.NoError(tb, lr.Setup(ctx))
	runInBackground(tb, ctx, lr.Run)
	pr, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: pollingPub, PollInterval: 10 * time.Millisecond, Logger: quiet})
	require.NoError(tb, err)
	runInBackground(tb, ctx, pr.Run)

	var mu sync.Mutex
	var ids []string
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWriter {
				id, _, err := e.writeOrder(ctx, int64(w*1000+i))
				if !assert.NoError(tb, err) {
					return
				}
				mu.Lock()
				ids = append(ids, id)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	exact := logicalPub.waitFor(tb, ctx, ids)
	polled := pollingPub.waitFor(tb, ctx, ids)
	over := make([]int64, 0, len(ids))
	for _, id := range ids {
		d := int64(polled[id][0].Token.Entries[0].LSN) - int64(exact[id][0].Token.Entries[0].LSN)
		require.GreaterOrEqual(tb, d, int64(0), "polling token below the commit end of event %s", id)
		over = append(over, d)
	}
	return over
}

// TestPollingTokenNeverBelowCommit: under concurrent writers, every
// polling token is at or past the exact end of its event's transaction
// (BenchmarkPollingTokenOverApproximation measures by how much).
func TestPollingTokenNeverBelowCommit(t *testing.T) {
	t.Parallel()
	require.Len(t, overApproximation(t, 4, 25), 100)
}

// BenchmarkPollingTokenOverApproximation reports how far past the commit
// the polling relay's tokens are, in WAL bytes, with 6 concurrent writers:
// what a consumer of polling-relayed events may wait for needlessly.
func BenchmarkPollingTokenOverApproximation(b *testing.B) {
	var over []int64
	for b.Loop() {
		over = append(over, overApproximation(b, 6, 50)...)
	}
	p := func(q float64) float64 { return float64(latency.Percentile(over, q)) }
	b.ReportMetric(p(0.5), "B-over-median")
	b.ReportMetric(p(0.9), "B-over-p90")
	b.ReportMetric(p(0.99), "B-over-p99")
	b.ReportMetric(p(1), "B-over-max")
}
