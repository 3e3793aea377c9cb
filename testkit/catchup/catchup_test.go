package catchup

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

var fcT0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func fcEpoch(tli uint32) position.Epoch {
	return position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: tli}
}

// fcRep is a healthy replica in recovery.
func fcRep(name string, tli uint32, at string, mods ...func(*replay.ReplicaState)) replay.ReplicaState {
	r := replay.ReplicaState{Name: name, Replayed: position.Replayed{Epoch: fcEpoch(tli), LSN: position.MustParseLSN(at)},
		InRecovery: true, Healthy: true, ObservedAt: fcT0.Add(-10 * time.Millisecond), Observations: 1}
	for _, m := range mods {
		m(&r)
	}
	return r
}

func fcDB(name string, replicas ...replay.ReplicaState) replay.DatabaseState {
	return replay.DatabaseState{Name: name, Replicas: replicas, Primary: replay.PrimaryState{
		Epoch: fcEpoch(1), HistoryKnown: true, InsertLSN: position.MustParseLSN("0/9000000"), ObservedAt: fcT0.Add(-20 * time.Millisecond)}}
}

func fcSnap(dbs ...replay.DatabaseState) *replay.Snapshot { return &replay.Snapshot{Databases: dbs} }

func fcEnt(db, at string) position.Entry {
	return position.Entry{Database: db, Epoch: fcEpoch(1), LSN: position.MustParseLSN(at), Source: position.SourcePrimary}
}

// TestFirstCaughtUp: the first snapshot in which the token is caught up
// names the time of the observation that showed it, whatever came
// between, and judges staleness by the snapshot's own time.
func TestFirstCaughtUp(t *testing.T) {
	t.Parallel()
	// at: observed at fcT0+d, read 2ms later.
	at := func(d time.Duration) func(*replay.ReplicaState) {
		return func(r *replay.ReplicaState) { r.ObservedAt, r.ReplayedBy = fcT0.Add(d), fcT0.Add(d+2*time.Millisecond) }
	}
	want := func(d time.Duration) CatchUp {
		return CatchUp{Observed: fcT0.Add(d), Read: fcT0.Add(d + 2*time.Millisecond)}
	}
	tk := position.Of(fcT0, fcEnt("main", "0/3000000"))
	s1 := fcSnap(fcDB("main", fcRep("r1", 1, "0/2000000", at(0)), fcRep("r2", 1, "0/1000000", at(time.Millisecond))))
	// r2 passes the token in an observation made at +10ms.
	s2 := fcSnap(fcDB("main", fcRep("r1", 1, "0/2000000", at(0)), fcRep("r2", 1, "0/3000000", at(10*time.Millisecond))))
	// r1 passes it too at +15ms; r2's +10ms remains the first.
	s3 := fcSnap(fcDB("main", fcRep("r1", 1, "0/3500000", at(15*time.Millisecond)), fcRep("r2", 1, "0/3000000", at(10*time.Millisecond))))

	got, ok := FirstCaughtUp(tk, []*replay.Snapshot{s1, s2, s3}, nil)
	require.True(t, ok)
	require.Equal(t, want(10*time.Millisecond), got)
	// A follower that skipped s2 still finds r2's observation.
	got, ok = FirstCaughtUp(tk, []*replay.Snapshot{s1, s3}, nil)
	require.True(t, ok)
	require.Equal(t, want(10*time.Millisecond), got)

	_, ok = FirstCaughtUp(tk, []*replay.Snapshot{s1}, nil)
	require.False(t, ok)
	_, ok = FirstCaughtUp(position.Token{}, []*replay.Snapshot{s3}, nil)
	require.False(t, ok)

	// A replica past the token but silent for longer than the staleness
	// bound, in a snapshot made of newer observations, is unknown.
	silent := fcSnap(fcDB("main", fcRep("r1", 1, "0/9000000", at(0)), fcRep("r2", 1, "0/1000000", at(5*time.Second))))
	_, ok = FirstCaughtUp(tk, []*replay.Snapshot{silent}, nil)
	require.False(t, ok)

	// Two databases: the later of the two catch-ups.
	tk2 := position.Of(fcT0, fcEnt("main", "0/3000000"), fcEnt("other", "0/100"))
	s4 := fcSnap(
		fcDB("main", fcRep("r1", 1, "0/3000000", at(20*time.Millisecond))),
		fcDB("other", fcRep("o1", 1, "0/200", at(30*time.Millisecond))),
	)
	got, ok = FirstCaughtUp(tk2, []*replay.Snapshot{s4}, nil)
	require.True(t, ok)
	require.Equal(t, want(30*time.Millisecond), got)
}
