package lab

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/catchup"
)

// TestFirstCatchUps checks the sweep against firstCaughtUp over
// the snapshots after each token's start, one token at a time, on
// snapshots whose replicas advance, fail, go stale and come back, for
// one- and two-database tokens of two epochs.
func TestFirstCatchUps(t *testing.T) {
	t.Parallel()
	cfg := consume.Config{}.WithDefaults()
	t0 := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	epochs := []position.Epoch{{SystemID: 7, Timeline: 1}, {SystemID: 9, Timeline: 1}}
	rng := rand.New(rand.NewPCG(1, 2))
	var found, missing int
	for round := range 20 {
		// Two databases of two replicas; each replica's replay grows
		// by random steps, and now and then it fails for a while or its
		// observations stop (stale after StalenessBound).
		dbs := []string{"main", "other"}
		replayed := [2][2]position.LSN{{100, 100}, {100, 100}}
		down := [2][2]int{}
		var snaps []*replay.Snapshot
		now := t0
		seq := uint64(0)
		for range 300 {
			now = now.Add(time.Duration(1+rng.IntN(200)) * time.Millisecond)
			seq += uint64(1 + rng.IntN(2)) // the follower skips some
			s := &replay.Snapshot{Seq: seq}
			for d, name := range dbs {
				ds := replay.DatabaseState{Name: name,
					Primary: replay.PrimaryState{Epoch: epochs[d], HistoryKnown: true, ObservedAt: now}}
				for r := range 2 {
					if down[d][r] > 0 {
						down[d][r]--
					} else if rng.IntN(40) == 0 {
						down[d][r] = 1 + rng.IntN(20)
					}
					replayed[d][r] += position.LSN(rng.IntN(50))
					rs := replay.ReplicaState{Name: "r", InRecovery: true, Healthy: true, ObservedAt: now,
						Replayed: position.Replayed{Epoch: epochs[d], LSN: replayed[d][r]}}
					if down[d][r] > 0 {
						if rng.IntN(2) == 0 {
							rs.Err = replay.ErrImpossibleObservation
						} else {
							rs.ObservedAt = now.Add(-2 * cfg.Tracker.StalenessBound)
						}
					}
					ds.Replicas = append(ds.Replicas, rs)
				}
				s.Databases = append(s.Databases, ds)
			}
			snaps = append(snaps, s)
		}
		var ws []waiting
		for range 400 {
			d := rng.IntN(2)
			tok := position.New(dbs[d], epochs[d], position.LSN(100+rng.IntN(300*25)), position.SourcePrimary, t0)
			if rng.IntN(5) == 0 {
				tok = tok.Merge(position.New(dbs[1-d], epochs[1-d], position.LSN(100+rng.IntN(300*25)), position.SourcePrimary, t0))
			}
			ws = append(ws, waiting{tok: tok, after: uint64(rng.IntN(int(seq)))})
		}
		firstCatchUps(ws, snaps, &cfg)
		for i, w := range ws {
			var want *replay.Snapshot
			for _, s := range snaps {
				if s.Seq <= w.after {
					continue
				}
				if _, ok := catchup.FirstCaughtUp(w.tok, []*replay.Snapshot{s}, &cfg); ok {
					want = s
					break
				}
			}
			if want == nil {
				require.False(t, w.found, "round %d token %d: found in a snapshot, but none shows it caught up", round, i)
				missing++
				continue
			}
			found++
			require.True(t, w.found, "round %d token %d: not found, snapshot %d shows it caught up", round, i, want.Seq)
			require.Equal(t, want.Seq, w.seq, "round %d token %d", round, i)
		}
	}
	t.Logf("%d tokens caught up, %d never", found, missing)
	require.Greater(t, found, 1000)
	require.Greater(t, missing, 100)
}

// TestLatencyOf: jobs run at once are left out, jobs started before their
// catch-up count as early (and as 0 in MeanEarlyZero only), jobs never
// seen caught up as never.
func TestLatencyOf(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	js := []jobCatchUp{
		{atOnce: true, found: true, read: at(0), start: at(500)},
		{found: true, read: at(0), start: at(10), replica: "r1"},
		{found: true, read: at(0), start: at(30), replica: "r1"},
		{found: true, read: at(100), start: at(40)},                // primary, before its catch-up
		{found: true, read: at(100), start: at(90), replica: "r2"}, // a stale read
		{found: false, start: at(5)},
	}
	st := latencyOf(js, func(*jobCatchUp) bool { return true })
	require.Equal(t, 5, st.Jobs)
	require.Equal(t, 4, st.N)
	require.Equal(t, 2, st.Early)
	require.Equal(t, 1, st.EarlyReplica)
	require.Equal(t, 1, st.Never)
	require.InDelta(t, 20.0, st.Mean, 1e-9)
	require.InDelta(t, 10.0, st.MeanEarlyZero, 1e-9)
	require.InDelta(t, 30.0, st.Max, 1e-9)

	d := drainOf(js, func(*jobCatchUp) bool { return true })
	require.Equal(t, 4, d.Jobs)
	require.InDelta(t, 90.0, d.StartSpan, 1e-9) // first catch-up at 0, last start at 90
	require.InDelta(t, 40.0, d.PeakRate, 1e-9)  // 4 starts within 100ms
}

// TestLargestBurst: the burst with the most jobs is measured, from its
// first catch-up; jobs run at once, never caught up or enqueued outside
// the pauses are left out.
func TestLargestBurst(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	paused := []pauseSpan{{from: at(0), to: at(1000)}, {from: at(2000), to: at(3000)}}
	js := []jobCatchUp{
		{enqueued: at(100), found: true, read: at(1010), start: at(1020)}, // the first burst: 1 job
		{enqueued: at(2100), found: true, read: at(3010), start: at(3030)},
		{enqueued: at(2200), found: true, read: at(3020), start: at(3050)},
		{enqueued: at(2300), found: true, read: at(3015), start: at(3070)},
		{enqueued: at(2400), atOnce: true, found: true, read: at(2400), start: at(2401)},
		{enqueued: at(2500), found: false, start: at(3500)},
		{enqueued: at(1500), found: true, read: at(1600), start: at(4000)}, // no pause
	}
	b := largestBurst(js, paused)
	require.Equal(t, 3, b.Jobs)
	require.InDelta(t, 60.0, b.Span, 1e-9)      // first catch-up 3010, last start 3070
	require.InDelta(t, 40.0, b.MeanStart, 1e-9) // (20 + 40 + 60) / 3
	require.Equal(t, burstDrain{}, largestBurst(js, nil))
}
