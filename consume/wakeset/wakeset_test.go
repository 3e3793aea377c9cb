package wakeset

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

var (
	t0    = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	epoch = position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}
)

func tokenAt(db string, lsn position.LSN) position.Token {
	return position.New(db, epoch, lsn, position.SourcePrimary, t0)
}

// replayedAt is a snapshot of databases "main" and "other" (those named)
// whose one replica, fresh at t0, has replayed the given position.
func replayedAt(lsns map[string]position.LSN) *replay.Snapshot {
	s := &replay.Snapshot{}
	for _, db := range []string{"main", "other"} {
		lsn, ok := lsns[db]
		if !ok {
			continue
		}
		s.Databases = append(s.Databases, replay.DatabaseState{
			Name:    db,
			Primary: replay.PrimaryState{Epoch: epoch, HistoryKnown: true, InsertLSN: 1 << 40, ObservedAt: t0},
			Replicas: []replay.ReplicaState{{
				Name: "r1", Replayed: position.Replayed{Epoch: epoch, LSN: lsn},
				InRecovery: true, Healthy: true, ObservedAt: t0, Observations: 1,
			}},
		})
	}
	return s
}

type entry = Entry[string, int]

func add(s *Set[string, int], id string, tok position.Token) *entry {
	e := &entry{Key: id, Token: tok, Expires: t0.Add(time.Minute)}
	s.Add(e)
	return e
}

func keys(es []*entry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.Key)
	}
	return out
}

// A scan hands out exactly the entries whose token the snapshot shows
// caught up, and entries naming several databases once all of them are;
// unknown (a stale observation, another history) is never caught up.
func TestScan(t *testing.T) {
	t.Parallel()
	cfg := consume.Config{}.WithDefaults()
	s := New[string, int](100)
	for i, lsn := range []position.LSN{300, 100, 500, 200, 400} {
		add(s, fmt.Sprint("m", i), tokenAt("main", lsn))
	}
	add(s, "o", tokenAt("other", 100))
	add(s, "both", position.Of(t0,
		position.Entry{Database: "main", Epoch: epoch, LSN: 100},
		position.Entry{Database: "other", Epoch: epoch, LSN: 50}))
	add(s, "foreign", position.New("main", position.Epoch{SystemID: 1, Timeline: 1}, 1, position.SourcePrimary, t0))
	require.Equal(t, 8, s.Len())
	require.ElementsMatch(t, []position.Entry{{Database: "main"}, {Database: "other"}}, s.Watched(nil).Entries)

	due := s.Scan(replayedAt(map[string]position.LSN{"main": 250}), t0, &cfg, t0, nil)
	require.ElementsMatch(t, []string{"m1", "m3"}, keys(due), "main at 250: the entries at 100 and 200")
	for _, e := range due {
		require.Equal(t, inFlight, e.state)
		s.Remove(e)
	}
	due = s.Scan(replayedAt(map[string]position.LSN{"main": 450, "other": 60}), t0, &cfg, t0, nil)
	require.ElementsMatch(t, []string{"m0", "m4", "both"}, keys(due), "both databases caught up for the two-database token; other at 60 is not at 100")
	for _, e := range due {
		s.Remove(e)
	}
	require.Empty(t, s.Scan(replayedAt(map[string]position.LSN{"main": 1000, "other": 1000}), t0.Add(time.Minute), &cfg, t0, nil),
		"an observation older than the staleness bound is unknown")
	due = s.Scan(replayedAt(map[string]position.LSN{"main": 1000, "other": 1000}), t0, &cfg, t0, nil)
	require.ElementsMatch(t, []string{"m2", "o"}, keys(due))
	require.Equal(t, 3, s.Len(), "in-flight entries stay until they come back")
	for _, e := range due {
		s.Remove(e)
	}
	require.Empty(t, s.Scan(replayedAt(map[string]position.LSN{"main": 1 << 30}), t0, &cfg, t0, nil), "a token of another system never catches up")
	require.Equal(t, 1, s.Len())
	require.Len(t, s.groups, 1)
}

// A job deferred again replaces its entry; a full set drops its oldest;
// entries expire oldest first; Forget removes by key; an entry put back
// is handed out again after a doubling backoff, capped.
func TestBounds(t *testing.T) {
	t.Parallel()
	cfg := consume.Config{}.WithDefaults()
	s := New[string, int](3)
	a := add(s, "a", tokenAt("main", 100))
	a2 := &entry{Key: "a", Token: tokenAt("main", 900), Expires: t0.Add(time.Minute)}
	replaced, evicted := s.Add(a2)
	require.True(t, replaced)
	require.Zero(t, evicted)
	require.Equal(t, 1, s.Len())
	require.Empty(t, s.Scan(replayedAt(map[string]position.LSN{"main": 500}), t0, &cfg, t0, nil), "the new token, 900, is not caught up at 500")
	require.False(t, s.Current(a))

	b, c := add(s, "b", tokenAt("main", 1)), add(s, "c", tokenAt("main", 1))
	d := &entry{Key: "d", Token: tokenAt("main", 1), Expires: t0.Add(time.Minute)}
	_, evicted = s.Add(d)
	require.Equal(t, 1, evicted)
	require.Equal(t, 3, s.Len())
	require.False(t, s.Current(a2), "the oldest entry is dropped")
	for _, e := range []*entry{b, c, d} {
		require.True(t, s.Current(e))
	}

	require.True(t, s.Forget("c"))
	require.False(t, s.Forget("c"))
	x := add(s, "x", tokenAt("main", 1))
	require.Equal(t, 1, s.RemoveFunc(func(e *entry) bool { return e.Key == "x" }))
	require.False(t, s.Current(x))
	require.Equal(t, 2, s.Len())

	b.Expires, d.Expires = t0.Add(time.Second), t0.Add(2*time.Second)
	require.Equal(t, b.Expires, s.Next())
	require.Zero(t, s.Expire(t0))
	require.Equal(t, 1, s.Expire(t0.Add(time.Second)))
	require.Equal(t, 1, s.Len())

	due := s.Scan(replayedAt(map[string]position.LSN{"main": 10}), t0, &cfg, t0, nil)
	require.Equal(t, []string{"d"}, keys(due))
	s.RetryAfter(d, t0)
	require.Equal(t, ready, d.state)
	require.Equal(t, 1, d.Tries())
	require.Equal(t, t0.Add(RetryMin), d.nextTry)
	require.Equal(t, d.nextTry, s.Next(), "a retry is due before the expiry")
	require.Empty(t, s.Scan(replayedAt(nil), t0, &cfg, t0, nil))
	due = s.Scan(replayedAt(nil), t0, &cfg, d.nextTry, nil)
	require.Equal(t, []string{"d"}, keys(due))
	s.RetryAfter(d, t0)
	require.Equal(t, t0.Add(2*RetryMin), d.nextTry, "the backoff doubles")
	for range 20 {
		s.Scan(replayedAt(nil), t0, &cfg, t0.Add(time.Hour), nil)
		s.RetryAfter(d, t0)
	}
	require.Equal(t, t0.Add(RetryMax), d.nextTry)
	s.Remove(d)
	s.RetryAfter(d, t0)
	require.Zero(t, s.Len())
	require.Empty(t, s.ready, "a removed entry is not put back")
	require.Empty(t, s.groups)
	require.Zero(t, s.Next())
}

// BenchmarkMemory measures what a remembered deferral costs: heap bytes
// per entry with a one-database token and an int64 key (B/entry), and a
// scan over 10,000 entries none of which is caught up (ns/op).
func BenchmarkMemory(b *testing.B) {
	const n = 10_000
	cfg := consume.Config{}.WithDefaults()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s := New[int64, int](n)
	for i := range n {
		s.Add(&Entry[int64, int]{Key: int64(i), Token: tokenAt("main", position.LSN(1000+i)), Expires: t0.Add(time.Minute)})
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	perEntry := float64(after.HeapAlloc-before.HeapAlloc) / n
	snap := replayedAt(map[string]position.LSN{"main": 10})
	var due []*Entry[int64, int]
	b.ResetTimer()
	for b.Loop() {
		due = s.Scan(snap, t0, &cfg, t0, due[:0])
	}
	b.StopTimer()
	require.Empty(b, due)
	runtime.KeepAlive(s)
	b.ReportMetric(perEntry, "B/entry")
}
