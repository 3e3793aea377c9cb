package lab

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// The reference figures: tokens put about 200 reads/s on the
// primary at 0.1 s lag, 3,000 at 2 s and 5,000 at 30 s; the 2 s window
// 3,000 flat with about 800 stale reads/s at 5 s.
func TestCapacityMatchesReferenceFigures(t *testing.T) {
	t.Parallel()
	rows := simulateCapacity(defaultReadDelays, capacityLags)
	byLag := map[float64]capacityRow{}
	for _, r := range rows {
		byLag[r.LagSeconds] = r
		require.Zero(t, r.TokensStale, "tokens read a stale replica at lag %gs", r.LagSeconds)
		require.Equal(t, 3000, r.WindowPrimary, "the window's primary load is flat")
		require.LessOrEqual(t, r.WaitPrimary, r.TokensPrimary, "waiting can only take load off the primary")
	}
	near := func(want, got int) {
		require.InDelta(t, want, got, float64(want)*0.02+2, "want about %d, got %d", want, got)
	}
	near(200, byLag[0.1].TokensPrimary)
	near(3000, byLag[2].TokensPrimary)
	near(5000, byLag[30].TokensPrimary)
	near(800, byLag[5].WindowStale)
	require.Zero(t, byLag[1].WindowStale, "a window longer than the lag reads nothing stale")
	// With a 50 ms wait only reads within 50 ms of their write still find
	// a 0.1 s replica behind: g(0.05) = 0.5% of 20,000 under linear
	// interpolation of g.
	near(100, byLag[0.1].WaitPrimary)

	var buf bytes.Buffer
	printCapacity(&buf, rows)
	t.Log("\n" + buf.String())
}
