package lab

import (
	"fmt"
	"io"
	"math"
	"time"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// The capacity simulation answers "how much read load stays on the
// primary" for a read pattern and a replica lag, by running every read of
// one second of traffic through the real consume.Decide. Nothing here is a
// closed formula: positions are WAL offsets, the replica's replay is a
// snapshot, and routing is what Decide returns for it.

// readDelay is one point of the cumulative distribution g: Fraction of all
// reads arrive within Seconds of the same session's last write.
type readDelay struct {
	Seconds  float64
	Fraction float64
}

// defaultReadDelays is issue #7's distribution. Reads past the last point
// (73%) follow writes older than a minute, or none.
var defaultReadDelays = []readDelay{
	{0.1, 0.01}, {0.5, 0.04}, {1, 0.08}, {2, 0.15}, {5, 0.19}, {10, 0.22}, {30, 0.25}, {60, 0.27},
}

// capacityLags are the replica lags the table reports.
var capacityLags = []float64{0.1, 0.5, 1, 2, 5, 10, 30, 60}

// capacityRow is one lag's result, in reads per second.
type capacityRow struct {
	LagSeconds    float64 `json:"lag_s"`
	TokensPrimary int     `json:"tokens_primary_rps"`
	WaitPrimary   int     `json:"tokens_wait50ms_primary_rps"`
	WindowPrimary int     `json:"window2s_primary_rps"`
	WindowStale   int     `json:"window2s_stale_rps"`
	TokensStale   int     `json:"tokens_stale_rps"`
}

const (
	simReadsPerSecond = 20000
	simWALBytesPerSec = 64 << 10 // WAL volume; any rate works, positions are linear in time
	simWait           = 50 * time.Millisecond
	simWindow         = 2 * time.Second
)

var simEpoch = position.Epoch{SystemID: 7_000_000_000_000_000_001, Timeline: 1}

// quantile inverts the piecewise-linear cumulative distribution: the delay
// below which a fraction u of reads arrive. ok is false past the last
// point (the read follows no recent write).
func quantile(g []readDelay, u float64) (seconds float64, ok bool) {
	prevS, prevF := 0.0, 0.0
	for _, p := range g {
		if u <= p.Fraction {
			return prevS + (u-prevF)/(p.Fraction-prevF)*(p.Seconds-prevS), true
		}
		prevS, prevF = p.Seconds, p.Fraction
	}
	return 0, false
}

// simulateCapacity routes one second of reads for each lag.
func simulateCapacity(g []readDelay, lags []float64) []capacityRow {
	now := time.Unix(1_800_000_000, 0)
	at := func(secondsAgo float64, from time.Time) position.LSN {
		// The WAL position written secondsAgo before from, relative to a
		// base far enough back that it never goes negative.
		base := float64(1 << 40)
		return position.LSN(base + (float64(from.UnixNano())/1e9-secondsAgo-1_700_000_000)*simWALBytesPerSec)
	}
	cfg := consume.Config{
		Databases:  map[string]replay.Database{"main": {}}, // health thresholds are not what this measures
		WaitBudget: simWait,
		Tracker:    replay.TrackerConfig{MaxLagBytes: math.MaxUint64, MaxLagTime: 24 * time.Hour},
	}.WithDefaults()
	snapshot := func(t time.Time, lag float64) *replay.Snapshot {
		return &replay.Snapshot{Databases: []replay.DatabaseState{{
			Name:    "main",
			Primary: replay.PrimaryState{Epoch: simEpoch, HistoryKnown: true, InsertLSN: at(0, t), ObservedAt: t},
			Replicas: []replay.ReplicaState{{
				Name: "replica1", InRecovery: true, Healthy: true, ObservedAt: t, Observations: 1,
				Replayed: position.Replayed{Epoch: simEpoch, LSN: at(lag, t)},
				TimeLag:  time.Duration(lag * float64(time.Second)),
			}},
		}}}
	}
	buf := make([]consume.DatabaseDecision, 0, 1)
	rows := make([]capacityRow, 0, len(lags))
	for _, lag := range lags {
		row := capacityRow{LagSeconds: lag}
		snap := snapshot(now, lag)
		later := snapshot(now.Add(simWait), lag)
		for i := range simReadsPerSecond {
			u := (float64(i) + 0.5) / simReadsPerSecond
			delay, recent := quantile(g, u)
			if !recent {
				delay = 3600
			}
			written := now.Add(-time.Duration(delay * float64(time.Second)))
			tok := position.New("main", simEpoch, at(delay, now), position.SourcePrimary, written)

			// Tokens: a caught-up replica, else the primary at once.
			d := consume.Decide(consume.DecideInput{Policy: consume.Sticky, Token: tok, Snapshot: snap, Now: now, Config: &cfg, Buf: buf})
			if d.Outcome != consume.OutcomeReplica {
				row.TokensPrimary++
			} else if staleOn(d, tok, snap) {
				row.TokensStale++
			}

			// Tokens with a 50 ms wait: Delayed asks to wait; after the
			// wait the replica has moved on, and what is still behind
			// goes to the primary.
			d = consume.Decide(consume.DecideInput{Policy: consume.Delayed, Token: tok, Snapshot: snap, Now: now, Config: &cfg, Buf: buf})
			if d.Action == consume.ActionWait {
				d = consume.Decide(consume.DecideInput{Policy: consume.Sticky, Token: tok, Snapshot: later, Now: now.Add(simWait), Config: &cfg, Waited: true, NoWait: true, Buf: buf})
			}
			if d.Outcome != consume.OutcomeReplica && d.Outcome != consume.OutcomeReplicaWaited {
				row.WaitPrimary++
			}

			// A 2 s window: the primary right after a write, any replica
			// after; stale when that replica has not replayed the write.
			if now.Sub(written) < simWindow {
				row.WindowPrimary++
			} else if e, _ := tok.Entry("main"); e.Compare(snap.Databases[0].Replicas[0].Replayed, nil).Status != position.CaughtUp {
				row.WindowStale++
			}
		}
		rows = append(rows, row)
	}
	return rows
}

// staleOn double-checks a replica decision against the snapshot: the
// simulation would report a stale read if Decide ever chose a replica that
// had not replayed the token.
func staleOn(d consume.Decision, tok position.Token, snap *replay.Snapshot) bool {
	dd, ok := d.Database("main")
	if !ok || dd.Replica == "" {
		return false
	}
	e, _ := tok.Entry("main")
	return e.Compare(snap.Databases[0].Replicas[0].Replayed, nil).Status != position.CaughtUp
}

func printCapacity(w io.Writer, rows []capacityRow) {
	fmt.Fprintf(w, "capacity: primary reads/s at %d reads/s, by replica lag (g: %v)\n", simReadsPerSecond, defaultReadDelays)
	fmt.Fprintf(w, "%8s  %14s  %20s  %16s  %14s  %13s\n", "lag", "tokens→primary", "tokens+50ms→primary", "window2s→primary", "window2s stale", "tokens stale")
	for _, r := range rows {
		fmt.Fprintf(w, "%7gs  %14d  %20d  %16d  %14d  %13d\n", r.LagSeconds, r.TokensPrimary, r.WaitPrimary, r.WindowPrimary, r.WindowStale, r.TokensStale)
	}
}
