package consume

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/latency"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// BenchmarkRestartWindow measures the window a replay.Guard closes: how
// much less than it had replayed a replica killed under write load shows
// when it accepts connections again, and for how long. Per restart: the
// replica's replay position just before SIGKILL; then, polling a fresh
// connection from the moment the restarted server accepts one, the
// position it shows first and the time until it is back at the old one.
// Without a guard, a job routed to the replica before the crash (or
// before the tracker's next poll, which fails while it is down) and
// reading inside that time can read stale rows. It prints a table and
// asserts nothing about time.
//
// Run it alone: go test -run '^$' -bench RestartWindow -benchtime 1x ./consume/
func BenchmarkRestartWindow(b *testing.B) {
	ctx := context.Background()
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1})
	require.NoError(b, err)
	b.Cleanup(func() { _ = c.Close() })
	e := setup(b, c)
	node := c.Replicas()[0]

	// Write load for the whole run: small transactions, as jobs' producers
	// make.
	loadCtx, stopLoad := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		for loadCtx.Err() == nil {
			_, _ = e.primary.Exec(loadCtx, "INSERT INTO items (v) SELECT 'load' FROM generate_series(1, 20)")
		}
	})
	defer func() { stopLoad(); wg.Wait() }()

	const restarts = 20
	var (
		behind   int
		deficits []uint64
		windows  []time.Duration
		downs    []time.Duration
	)
	for b.Loop() {
		for range restarts {
			time.Sleep(200 * time.Millisecond) // let WAL accumulate since the last restart
			conn, err := pgx.Connect(ctx, node.DSN(e.db))
			require.NoError(b, err)
			before, err := pgwal.ReadReplica(ctx, conn, 0)
			require.NoError(b, err)
			killed := time.Now()
			require.NoError(b, node.Kill())
			_ = conn.Close(ctx)
			require.NoError(b, node.StartAccepting(ctx))
			var first position.LSN
			var accepted time.Time
			for {
				conn, err = pgx.Connect(ctx, node.DSN(e.db))
				if err == nil {
					break
				}
				time.Sleep(time.Millisecond)
			}
			for {
				r, err := pgwal.ReadReplica(ctx, conn, 0)
				require.NoError(b, err)
				if accepted.IsZero() {
					accepted, first = time.Now(), r.LSN
					downs = append(downs, accepted.Sub(killed))
				}
				if r.LSN >= before.LSN {
					if first < before.LSN {
						behind++
						deficits = append(deficits, uint64(before.LSN-first))
						windows = append(windows, time.Since(accepted))
					}
					break
				}
			}
			_ = conn.Close(ctx)
		}
	}
	b.Log(fmt.Sprintf("\n| restarts | first connection below the pre-crash replay | deficit p50 / max (bytes) | accept → back at pre-crash replay p50 / p99 / max | kill → accepting p50 |\n|---|---|---|---|---|\n| %d | %d | %d / %d | %v / %v / %v | %v |\n",
		len(downs), behind, latency.Percentile(deficits, 0.5), latency.Percentile(deficits, 1),
		latency.Percentile(windows, 0.5), latency.Percentile(windows, 0.99), latency.Percentile(windows, 1),
		latency.Percentile(downs, 0.5).Round(time.Millisecond)))
}
