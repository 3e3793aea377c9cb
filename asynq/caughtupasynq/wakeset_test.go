package caughtupasynq

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/consume/wakeset"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// The waker's set is consume/wakeset's, tested there; what is asynq's is
// the key: a task id is unique within its queue only.

var wt0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// TestWakeSetKeyPerQueue: the same task id in another queue is another
// task, neither forgotten nor replaced by this one's deferral.
func TestWakeSetKeyPerQueue(t *testing.T) {
	t.Parallel()
	s := wakeset.New[taskKey, wakeTask](10)
	b := &wakeEntry{Key: taskKey{queue: "q", id: "b"}, Token: tokenAt("main", 1, wt0), Expires: wt0.Add(time.Minute)}
	s.Add(b)
	require.False(t, s.Forget(taskKey{queue: "other", id: "b"}), "task ids are per queue")
	require.True(t, s.Current(b))
	ob := &wakeEntry{Key: taskKey{queue: "other", id: "b"}, Token: tokenAt("main", 1, wt0), Expires: wt0.Add(time.Minute)}
	replaced, evicted := s.Add(ob)
	require.False(t, replaced, "task ids are per queue")
	require.Zero(t, evicted)
	require.Equal(t, 2, s.Len())
	require.True(t, s.Forget(taskKey{queue: "q", id: "b"}))
	require.True(t, s.Current(ob))
}

// BenchmarkWakeSetMemory measures what a remembered deferral costs in the
// waker's set: heap bytes per entry with a one-database token and asynq's
// UUID task ids (B/entry), and the time of a scan over 10,000 entries
// none of which is caught up (ns/op).
func BenchmarkWakeSetMemory(b *testing.B) {
	const n = 10_000
	cfg := consume.Config{}.WithDefaults()
	build := func() *wakeset.Set[taskKey, wakeTask] {
		s := wakeset.New[taskKey, wakeTask](n)
		for i := range n {
			tok := tokenAt("main", position.LSN(1000+i), wt0)
			id := fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", i, i&0xffff, i&0xfff, i&0xfff, i) // as long as asynq's UUIDs
			s.Add(&wakeEntry{Key: taskKey{queue: "default", id: id}, Token: tok, Expires: wt0.Add(time.Minute)})
		}
		return s
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s := build()
	runtime.GC()
	runtime.ReadMemStats(&after)
	perEntry := float64(after.HeapAlloc-before.HeapAlloc) / n
	// One replica of "main", fresh at wt0, behind every entry.
	snap := &replay.Snapshot{Databases: []replay.DatabaseState{{
		Name:    "main",
		Primary: replay.PrimaryState{Epoch: epoch, HistoryKnown: true, InsertLSN: 1 << 40, ObservedAt: wt0},
		Replicas: []replay.ReplicaState{{
			Name: "r1", Replayed: position.Replayed{Epoch: epoch, LSN: 10},
			InRecovery: true, Healthy: true, ObservedAt: wt0, Observations: 1,
		}},
	}}}
	var due []*wakeEntry
	b.ResetTimer()
	for b.Loop() {
		due = s.Scan(snap, wt0, &cfg, wt0, due[:0])
	}
	b.StopTimer()
	require.Empty(b, due)
	runtime.KeepAlive(s)
	b.ReportMetric(perEntry, "B/entry")
}
