package enqueue

import (
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/internal/pgwal"
)

func TestSysIDCache(t *testing.T) {
	t.Parallel()
	var c sysIDCache
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	a, b := new(pgconn.PgConn), new(pgconn.PgConn)

	_, ok := c.get(a, now, time.Minute)
	require.False(t, ok)
	c.put(a, pgwal.ControlFile{SystemID: 7}, now)
	id, ok := c.get(a, now.Add(59*time.Second), time.Minute)
	require.True(t, ok)
	require.Equal(t, uint64(7), id.SystemID)
	_, ok = c.get(a, now.Add(time.Minute), time.Minute)
	require.False(t, ok, "due for refresh")
	_, ok = c.get(a, now.Add(-time.Second), time.Minute)
	require.False(t, ok, "clock stepped back")
	_, ok = c.get(a, now, -1)
	require.False(t, ok, "negative refresh: always read")
	_, ok = c.get(b, now, time.Minute)
	require.False(t, ok, "another connection")

	c.put(a, pgwal.ControlFile{SystemID: 8}, now) // refresh: same entry, no second cleanup
	require.Equal(t, 1, c.len())
	runtime.KeepAlive(a)
	runtime.KeepAlive(b)
}

func TestSysIDCacheForgetsCollectedConnections(t *testing.T) {
	t.Parallel()
	var c sysIDCache
	now := time.Now()
	for range 100 {
		c.put(new(pgconn.PgConn), pgwal.ControlFile{SystemID: 1}, now)
	}
	require.Equal(t, 100, c.len())
	require.Eventually(t, func() bool {
		runtime.GC()
		return c.len() == 0
	}, 5*time.Second, 10*time.Millisecond)
}
