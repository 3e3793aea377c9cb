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
