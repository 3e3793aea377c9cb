package consume

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// allowEnv is a unit router over two databases whose replicas are behind
// every token, with its metrics.
type allowEnv struct {
	r      *Router
	reader *sdkmetric.ManualReader
}

func newAllowEnv(t *testing.T, mods ...func(*Config)) allowEnv {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	s := snap(dbState("main", 1, nil, rep("r1", 1, "0/1000000")), dbState("other", 1, nil, rep("r1", 1, "0/1000000")))
	r := unitRouter(t, s, append([]func(*Config){func(c *Config) {
		c.MeterProvider = mp
		c.Now = func() time.Time { return t0 }
	}}, mods...)...)
	return allowEnv{r: r, reader: reader}
}

func (e allowEnv) checks(t *testing.T, budget, result string) int64 {
	t.Helper()
	return metrictest.Sum(t, e.reader, "caughtup.consume.fallback.budget",
		attribute.String(attrBudget, budget), attribute.String(attrResult, result))
}

// behindJob is a job no replica of the env has caught up with: Sticky, it
// falls back to the primary at once.
func behindJob() Job {
	return Job{Token: tok(time.Second, ent("main", 1, "0/2000000")), Policy: Sticky}
}

// TestAllowFallbackSharesTheCap: reads charged by AllowFallback and
// Route's fallbacks draw from one per-process cap, and each check is
// counted like a decision's.
func TestAllowFallbackSharesTheCap(t *testing.T) {
	t.Parallel()
	e := newAllowEnv(t, func(c *Config) { c.PrimaryRate, c.PrimaryBurst = 1e-9, 3 })
	ctx := context.Background()

	_, d, err := e.r.Route(ctx, behindJob())
	require.NoError(t, err)
	require.True(t, d.Fallback, "%+v", d)
	require.True(t, e.r.AllowFallback(ctx, "main"))
	require.True(t, e.r.AllowFallback(ctx, "main", "other"))
	require.False(t, e.r.AllowFallback(ctx, "main"), "the burst of 3 is spent")
	require.False(t, e.r.AllowFallback(ctx), "no database named: the per-process cap still applies")
	_, d, err = e.r.Route(ctx, behindJob())
	require.ErrorIs(t, err, ErrCapped, "AllowFallback's reads spent the cap jobs fall back under")
	require.Equal(t, OutcomeCapped, d.Outcome)

	require.EqualValues(t, 3, e.checks(t, "local", "allowed"))
	require.EqualValues(t, 3, e.checks(t, "local", "spent"))
	require.Zero(t, e.checks(t, "fleet", "allowed"), "no fleet budget configured")
}

// TestAllowFallbackUncapped: with the per-process cap off (rate.Inf) and
// no fleet budget, every read is allowed.
func TestAllowFallbackUncapped(t *testing.T) {
	t.Parallel()
	e := newAllowEnv(t, func(c *Config) { c.PrimaryRate = rate.Inf })
	for range 1000 {
		require.True(t, e.r.AllowFallback(context.Background(), "main"))
	}
	require.EqualValues(t, 1000, e.checks(t, "local", "allowed"))
}

// TestAllowFallbackFleetBudget: each database named is charged to its own
// fleet budget (in a real Redis), once however often it is named; a
// fleet refusal returns false and leaves the per-process cap untouched.
func TestAllowFallbackFleetBudget(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: pgtest.SharedRedis(t).Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	budget, err := feed.NewBudget(feed.BudgetConfig{Client: rdb, Rate: 1, Period: time.Hour, Burst: 2,
		Prefix: fmt.Sprintf("caughtup.budget.%s.%d.", t.Name(), time.Now().UnixNano())})
	require.NoError(t, err)
	e := newAllowEnv(t, func(c *Config) {
		c.FleetBudget = budget
		c.PrimaryRate, c.PrimaryBurst = 1e-9, 50
	})
	ctx := context.Background()

	require.True(t, e.r.AllowFallback(ctx, "main", "main"), "main charged once")
	require.True(t, e.r.AllowFallback(ctx, "main", "other"))
	require.False(t, e.r.AllowFallback(ctx, "main"), "main's fleet budget (burst 2) is spent")
	require.True(t, e.r.AllowFallback(ctx, "other"), "other's is not")
	require.False(t, e.r.AllowFallback(ctx, "other"))

	require.EqualValues(t, 4, e.checks(t, "fleet", "allowed"))
	require.EqualValues(t, 2, e.checks(t, "fleet", "spent"))
	require.EqualValues(t, 3, e.checks(t, "local", "allowed"))
	require.Zero(t, e.checks(t, "local", "spent"))
	require.InDelta(t, 47, e.r.gate.lim.Tokens(), 0.01, "fleet refusals took no local token")
}

// TestAllowFallbackFleetUnavailable: with the budget's Redis down, the
// per-process cap alone decides, as for jobs, and that is counted.
func TestAllowFallbackFleetUnavailable(t *testing.T) {
	t.Parallel()
	rs, err := pgtest.StartRedis(ctxT(t))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, rs.Close()) })
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr(), DialTimeout: time.Second, ReadTimeout: time.Second, MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	budget, err := feed.NewBudget(feed.BudgetConfig{Client: rdb, Rate: 1000, Burst: 1000})
	require.NoError(t, err)
	e := newAllowEnv(t, func(c *Config) {
		c.FleetBudget = budget
		c.PrimaryRate, c.PrimaryBurst = 1e-9, 2
	})
	require.NoError(t, rs.Stop())
	ctx := context.Background()
	require.True(t, e.r.AllowFallback(ctx, "main"))
	require.True(t, e.r.AllowFallback(ctx, "main"))
	require.False(t, e.r.AllowFallback(ctx, "main"), "the per-process burst")
	require.EqualValues(t, 2, e.checks(t, "fleet", "unavailable"))
	require.EqualValues(t, 2, e.checks(t, "local", "allowed"))
	require.EqualValues(t, 1, e.checks(t, "local", "spent"))
}
