package enqueue

import (
	"context"
	"errors"
	"fmt"
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

// TestSessionContext: WithSession's context is the parent with the
// session, as context.WithValue would give, in one allocation: values,
// cancellation and its cause, and its text.
func TestSessionContext(t *testing.T) {
	t.Parallel()
	type key struct{}
	parent, cancel := context.WithCancelCause(context.WithValue(context.Background(), key{}, "v"))
	ctx := WithSession(parent)
	require.Equal(t, fmt.Sprint(context.WithValue(parent, sessionKey{}, &session{})), fmt.Sprint(ctx))
	require.Equal(t, "v", ctx.Value(key{}))
	s, ok := ctx.Value(sessionKey{}).(*session)
	require.True(t, ok)
	require.Same(t, s, WithSession(ctx).Value(sessionKey{}))

	derived, stop := context.WithTimeout(ctx, time.Minute)
	defer stop()
	after := make(chan struct{})
	context.AfterFunc(ctx, func() { close(after) })
	cause := errors.New("client gone")
	cancel(cause)
	<-derived.Done()
	<-after
	require.ErrorIs(t, ctx.Err(), context.Canceled)
	require.Equal(t, cause, context.Cause(ctx))
	require.Equal(t, cause, context.Cause(derived))
	require.Same(t, s, context.WithoutCancel(ctx).Value(sessionKey{}))
}

// TestSessionOneAllocation: the net/http middleware opens a session per
// request. (Not parallel: AllocsPerRun.)
func TestSessionOneAllocation(t *testing.T) {
	bg := context.Background()
	require.Equal(t, 1.0, testing.AllocsPerRun(100, func() { _ = WithSession(bg) }))
}
