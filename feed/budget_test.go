package feed_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
)

// TestBudgetShared: two processes' worth of clients (two connections, two
// Budgets) draw on one key; together they never pass more than
// rate×t + burst, t measured on Redis's clock, which is the one GCRA uses.
func TestBudgetShared(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	const rate, burst = 20, 5
	key := feedName(t)
	var budgets []*feed.Budget
	for range 2 {
		b, err := feed.NewBudget(feed.BudgetConfig{Client: client(t, nil), Rate: rate, Burst: burst, Timeout: 5 * time.Second})
		require.NoError(t, err)
		budgets = append(budgets, b)
	}
	clock := client(t, nil)
	start, err := clock.Time(ctx).Result()
	require.NoError(t, err)

	var allowed atomic.Int64
	var wg sync.WaitGroup
	for _, b := range budgets {
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 150 {
					ok, err := b.Allow(ctx, key)
					if err != nil {
						t.Error(err)
						return
					}
					if ok {
						allowed.Add(1)
					}
				}
			}()
		}
	}
	wg.Wait()
	end, err := clock.Time(ctx).Result()
	require.NoError(t, err)
	elapsed := end.Sub(start)
	bound := rate*elapsed.Seconds() + burst
	t.Logf("%d of 600 allowed in %v (bound %.1f)", allowed.Load(), elapsed, bound)
	require.LessOrEqual(t, float64(allowed.Load()), bound+1, "at most rate×t + burst (+1 for the clock's rounding)")
	require.GreaterOrEqual(t, allowed.Load(), int64(burst), "a fresh budget passes its burst")

	// Another key has its own budget.
	ok, err := budgets[0].Allow(ctx, key+"-other")
	require.NoError(t, err)
	require.True(t, ok)
}

// TestBudgetUnavailable: without Redis, Allow errs within its timeout,
// wrapping ErrBudgetUnavailable, then stays off Redis for the cooldown.
func TestBudgetUnavailable(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	c := client(t, &redis.Options{Addr: blackhole(t), MaxRetries: -1, ReadTimeout: 300 * time.Millisecond})
	b, err := feed.NewBudget(feed.BudgetConfig{Client: c, Rate: 10, Timeout: 50 * time.Millisecond, Cooldown: time.Hour})
	require.NoError(t, err)
	began := time.Now()
	ok, err := b.Allow(ctx, "main")
	t.Logf("first Allow took %v (Timeout 50ms; the client's ReadTimeout 300ms): %v", time.Since(began), err)
	require.ErrorIs(t, err, feed.ErrBudgetUnavailable)
	require.False(t, ok)
	ok, err = b.Allow(ctx, "main")
	require.ErrorIs(t, err, feed.ErrBudgetUnavailable)
	require.Contains(t, err.Error(), "less than")
	require.False(t, ok)

	// A caller's own cancellation is not Redis's fault: no cooldown.
	b2, err := feed.NewBudget(feed.BudgetConfig{Client: client(t, nil), Rate: 10})
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = b2.Allow(cctx, feedName(t))
	require.ErrorIs(t, err, feed.ErrBudgetUnavailable)
	ok, err = b2.Allow(ctx, feedName(t))
	require.NoError(t, err)
	require.True(t, ok)

	_, err = feed.NewBudget(feed.BudgetConfig{Client: c})
	require.ErrorIs(t, err, feed.ErrInvalidConfig, "Rate is required")
}
