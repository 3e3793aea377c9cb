package caughtupasynq

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

var wt0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// replayedAt is a snapshot of database "main" whose one replica, fresh at
// wt0, has replayed lsn; other databases are listed with theirs.
func replayedAt(lsns map[string]position.LSN) *replay.Snapshot {
	s := &replay.Snapshot{}
	for _, db := range []string{"main", "other"} {
		lsn, ok := lsns[db]
		if !ok {
			continue
		}
		s.Databases = append(s.Databases, replay.DatabaseState{
			Name:    db,
			Primary: replay.PrimaryState{Epoch: epoch, HistoryKnown: true, InsertLSN: 1 << 40, ObservedAt: wt0},
			Replicas: []replay.ReplicaState{{
				Name: "r1", Replayed: position.Replayed{Epoch: epoch, LSN: lsn},
				InRecovery: true, Healthy: true, ObservedAt: wt0, Observations: 1,
			}},
		})
	}
	return s
}

func entry(id string, tok position.Token) *wakeEntry {
	return &wakeEntry{key: taskKey{queue: "q", id: id}, tok: tok, expires: wt0.Add(time.Minute)}
}

func ids(es []*wakeEntry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.key.id)
	}
	return out
}

// TestWakeSetScan: a scan hands out exactly the entries whose token the
// snapshot shows caught up, lowest positions first per database, and
// entries naming several databases once all of them are.
func TestWakeSetScan(t *testing.T) {
	t.Parallel()
	cfg := consume.Config{}.WithDefaults()
	s := newWakeSet(100)
	for i, lsn := range []position.LSN{300, 100, 500, 200, 400} {
		s.add(entry(fmt.Sprint("m", i), tokenAt("main", lsn, wt0)))
	}
	s.add(entry("o", tokenAt("other", 100, wt0)))
	s.add(entry("both", position.Of(wt0,
		position.Entry{Database: "main", Epoch: epoch, LSN: 100},
		position.Entry{Database: "other", Epoch: epoch, LSN: 50})))
	// Another history: never caught up on this system.
	s.add(entry("foreign", position.New("main", position.Epoch{SystemID: 1, Timeline: 1}, 1, position.SourcePrimary, wt0)))
	require.Equal(t, 8, s.len())
	require.ElementsMatch(t, []position.Entry{{Database: "main"}, {Database: "other"}}, s.watched(nil).Entries)

	due := s.scan(replayedAt(map[string]position.LSN{"main": 250}), wt0, &cfg, wt0, nil)
	require.ElementsMatch(t, []string{"m1", "m3"}, ids(due), "main at 250: the entries at 100 and 200")
	for _, e := range due {
		require.Equal(t, inFlight, e.state)
		s.remove(e)
	}
	due = s.scan(replayedAt(map[string]position.LSN{"main": 450, "other": 60}), wt0, &cfg, wt0, nil)
	require.ElementsMatch(t, []string{"m0", "m4", "both"}, ids(due), "both databases caught up for the two-database token; other at 60 is not at 100")
	for _, e := range due {
		s.remove(e)
	}
	// Unknown is never caught up: a stale observation.
	require.Empty(t, s.scan(replayedAt(map[string]position.LSN{"main": 1000, "other": 1000}), wt0.Add(time.Minute), &cfg, wt0, nil))
	due = s.scan(replayedAt(map[string]position.LSN{"main": 1000, "other": 1000}), wt0, &cfg, wt0, nil)
	require.ElementsMatch(t, []string{"m2", "o"}, ids(due))
	require.Equal(t, 3, s.len(), "in-flight entries stay until their attempt finishes")
	for _, e := range due {
		s.remove(e)
	}
	require.Empty(t, s.scan(replayedAt(map[string]position.LSN{"main": 1 << 30}), wt0, &cfg, wt0, nil), "a token of another system never catches up")
	require.Equal(t, 1, s.len())
	require.Len(t, s.groups, 1)
}

// TestWakeSetBounds: a task deferred again replaces its entry (new
// token); a full set drops its oldest entry; entries expire oldest first;
// a task that comes back is forgotten; an entry not movable yet is tried
// again after a growing backoff.
func TestWakeSetBounds(t *testing.T) {
	t.Parallel()
	cfg := consume.Config{}.WithDefaults()
	s := newWakeSet(3)
	a := entry("a", tokenAt("main", 100, wt0))
	s.add(a)
	a2 := entry("a", tokenAt("main", 900, wt0))
	replaced, evicted := s.add(a2)
	require.True(t, replaced)
	require.Zero(t, evicted)
	require.Equal(t, 1, s.len())
	require.Empty(t, s.scan(replayedAt(map[string]position.LSN{"main": 500}), wt0, &cfg, wt0, nil), "the new token, 900, is not caught up at 500")
	require.False(t, s.current(a))

	b, c, d := entry("b", tokenAt("main", 1, wt0)), entry("c", tokenAt("main", 1, wt0)), entry("d", tokenAt("main", 1, wt0))
	s.add(b)
	s.add(c)
	_, evicted = s.add(d)
	require.Equal(t, 1, evicted)
	require.Equal(t, 3, s.len())
	require.False(t, s.current(a2), "the oldest entry is dropped")
	for _, e := range []*wakeEntry{b, c, d} {
		require.True(t, s.current(e))
	}

	require.True(t, s.forget(taskKey{queue: "q", id: "c"}))
	require.False(t, s.forget(taskKey{queue: "q", id: "c"}))
	require.False(t, s.forget(taskKey{queue: "other", id: "b"}), "task ids are per queue")

	b.expires, d.expires = wt0.Add(time.Second), wt0.Add(2*time.Second)
	require.Equal(t, b.expires, s.next())
	require.Zero(t, s.expire(wt0))
	require.Equal(t, 1, s.expire(wt0.Add(time.Second)))
	require.Equal(t, 1, s.len())

	due := s.scan(replayedAt(map[string]position.LSN{"main": 10}), wt0, &cfg, wt0, nil)
	require.Equal(t, []string{"d"}, ids(due))
	s.retryAfter(d, wt0)
	require.Equal(t, ready, d.state)
	require.Equal(t, wt0.Add(wakeRetryMin), d.nextTry)
	require.Equal(t, d.nextTry, s.next(), "a retry is due before the expiry")
	require.Empty(t, s.scan(replayedAt(nil), wt0, &cfg, wt0, nil))
	due = s.scan(replayedAt(nil), wt0, &cfg, d.nextTry, nil)
	require.Equal(t, []string{"d"}, ids(due))
	s.retryAfter(d, wt0)
	require.Equal(t, wt0.Add(2*wakeRetryMin), d.nextTry, "the backoff doubles")
	for range 20 {
		s.scan(replayedAt(nil), wt0, &cfg, wt0.Add(time.Hour), nil)
		s.retryAfter(d, wt0)
	}
	require.Equal(t, wt0.Add(wakeRetryMax), d.nextTry)
	s.remove(d)
	require.Zero(t, s.len())
	require.Empty(t, s.ready)
	require.Empty(t, s.groups)
	require.Zero(t, s.next())
}

// BenchmarkWakeSetMemory measures what a remembered deferral costs: heap
// bytes per entry with a one-database token and asynq's UUID task ids
// (B/entry), and the time of a scan over 10,000 entries none of which is
// caught up (ns/op).
func BenchmarkWakeSetMemory(b *testing.B) {
	const n = 10_000
	cfg := consume.Config{}.WithDefaults()
	build := func() *wakeSet {
		s := newWakeSet(n)
		for i := range n {
			tok := tokenAt("main", position.LSN(1000+i), wt0)
			id := fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", i, i&0xffff, i&0xfff, i&0xfff, i) // as long as asynq's UUIDs
			s.add(&wakeEntry{key: taskKey{queue: "default", id: id}, tok: tok, expires: wt0.Add(time.Minute)})
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
	snap := replayedAt(map[string]position.LSN{"main": 10})
	var due []*wakeEntry
	b.ResetTimer()
	for b.Loop() {
		due = s.scan(snap, wt0, &cfg, wt0, due[:0])
	}
	b.StopTimer()
	require.Empty(b, due)
	runtime.KeepAlive(s)
	b.ReportMetric(perEntry, "B/entry")
}
