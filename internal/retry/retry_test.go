package retry

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestNth(t *testing.T) {
	t.Parallel()
	for n, want := range []time.Duration{100, 100, 200, 400, 800, 1000, 1000} {
		require.Equal(t, want*time.Millisecond, Nth(max(n, 1), 100*time.Millisecond, time.Second), "n=%d", n)
	}
}

func TestDoublingIsDeterministicAndNeverStops(t *testing.T) {
	t.Parallel()
	a, b := Doubling(time.Millisecond, 8*time.Millisecond), Doubling(time.Millisecond, 8*time.Millisecond)
	for range 100 {
		d := a.NextBackOff()
		require.Equal(t, d, b.NextBackOff())
		require.Positive(t, d, "never backoff.Stop")
	}
	j := Jittered(time.Second, time.Minute)
	for range 100 {
		d := j.NextBackOff()
		require.Positive(t, d)
		require.LessOrEqual(t, d, 90*time.Second)
	}
}

func TestSleep(t *testing.T) {
	t.Parallel()
	require.True(t, Sleep(context.Background(), time.Millisecond))
	require.True(t, Sleep(context.Background(), 0))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.False(t, Sleep(ctx, time.Hour))
	require.False(t, Sleep(ctx, 0))
}

// TestStepsIsExponential: Steps and backoff's ExponentialBackOff without
// jitter are one schedule, for every shape the router's config allows
// (a multiplier of 1, an initial interval above the cap, intervals that
// would overflow).
func TestStepsIsExponential(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		initial, max time.Duration
		multiplier   float64
	}{
		{100 * time.Millisecond, 30 * time.Second, 2},
		{time.Second, time.Minute, 1.5},
		{time.Second, time.Second, 2},
		{5 * time.Second, time.Second, 2},
		{time.Millisecond, time.Hour, 1},
		{3 * time.Millisecond, 7 * time.Second, 3.7},
		{time.Nanosecond, time.Duration(1<<62 + 12345), 10},
	} {
		b := Exponential(tc.initial, tc.max, tc.multiplier, 0)
		s := NewSteps(tc.initial, tc.max, tc.multiplier)
		for i := range 80 {
			require.Equal(t, b.NextBackOff(), s.Next(), "%+v step %d", tc, i)
		}
	}
}
