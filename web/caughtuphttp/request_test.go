package caughtuphttp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

type routeCtxKey struct{}

// TestRouteContext: Route's context behaves as context.WithTimeout's
// would, while making no timer until something waits on it.
func TestRouteContext(t *testing.T) {
	t.Parallel()
	parent := context.WithValue(context.Background(), routeCtxKey{}, "v")

	t.Run("unused", func(t *testing.T) {
		t.Parallel()
		c := &routeContext{parent: parent, deadline: time.Now().Add(time.Hour)}
		require.NoError(t, c.Err())
		d, ok := c.Deadline()
		require.True(t, ok)
		require.Equal(t, c.deadline, d)
		require.Equal(t, "v", c.Value(routeCtxKey{}))
		require.Nil(t, c.timed, "asking for Err, Deadline or a Value makes no timer")
		c.release()
		require.ErrorIs(t, c.Err(), context.Canceled, "released, as a cancelled WithTimeout")
		select {
		case <-c.Done():
		default:
			t.Fatal("Done is open after release")
		}
	})
	t.Run("deadline", func(t *testing.T) {
		t.Parallel()
		c := &routeContext{parent: parent, deadline: time.Now().Add(20 * time.Millisecond)}
		derived, cancel := context.WithCancel(c)
		defer cancel()
		<-c.Done()
		require.ErrorIs(t, c.Err(), context.DeadlineExceeded)
		<-derived.Done()
		require.ErrorIs(t, derived.Err(), context.DeadlineExceeded, "a derived context ends with it")
		c.release()
		require.ErrorIs(t, c.Err(), context.DeadlineExceeded, "the first end stays")
	})
	t.Run("past deadline", func(t *testing.T) {
		t.Parallel()
		c := &routeContext{parent: parent, deadline: time.Now().Add(-time.Millisecond)}
		require.ErrorIs(t, c.Err(), context.DeadlineExceeded)
		<-c.Done()
		c.release()
	})
	t.Run("parent ends", func(t *testing.T) {
		t.Parallel()
		p, cancel := context.WithCancelCause(parent)
		c := &routeContext{parent: p, deadline: time.Now().Add(time.Hour)}
		done := c.Done()
		cause := errors.New("client gone")
		cancel(cause)
		<-done
		require.ErrorIs(t, c.Err(), context.Canceled)
		require.ErrorIs(t, context.Cause(c), cause, "the request's cause")
		c.release()
	})
	t.Run("parent ended before", func(t *testing.T) {
		t.Parallel()
		p, cancel := context.WithCancel(parent)
		cancel()
		c := &routeContext{parent: p, deadline: time.Now().Add(time.Hour)}
		require.ErrorIs(t, c.Err(), context.Canceled)
		c.release()
	})
	t.Run("parent deadline first", func(t *testing.T) {
		t.Parallel()
		p, cancel := context.WithTimeout(parent, time.Minute)
		defer cancel()
		c := &routeContext{parent: p, deadline: time.Now().Add(time.Hour)}
		pd, _ := p.Deadline()
		d, ok := c.Deadline()
		require.True(t, ok)
		require.Equal(t, pd, d)
		c.release()
	})
	t.Run("AfterFunc", func(t *testing.T) {
		t.Parallel()
		c := &routeContext{parent: parent, deadline: time.Now().Add(time.Hour)}
		ran := make(chan struct{})
		stop := context.AfterFunc(c, func() { close(ran) })
		defer stop()
		c.release()
		<-ran
	})
}

// TestFloor: a request without a session gets an entry at position 0 for
// every database whose primary's epoch is current, reused for the same
// snapshot while the same databases are current, and made again when
// either changes.
func TestFloor(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 6, 9, 0, 0, 0, time.UTC)
	clock := now
	m := &Middleware{databases: []string{"a", "b"}, staleness: time.Second, routerNow: func() time.Time { return clock }}
	ep := position.Epoch{SystemID: 7, Timeline: 1}
	snap := &replay.Snapshot{Databases: []replay.DatabaseState{
		{Name: "a", Primary: replay.PrimaryState{Epoch: ep, ObservedAt: now}},
		{Name: "b", Primary: replay.PrimaryState{Epoch: ep, ObservedAt: now.Add(-500 * time.Millisecond)}},
	}}
	want := []position.Entry{{Database: "a", Epoch: ep}, {Database: "b", Epoch: ep}}

	f1 := m.floorOf(snap)
	require.Equal(t, want, f1)
	require.Equal(t, position.Token{Entries: f1, CapturedAt: now}, m.jobToken(carried{}, snap, now))
	f2 := m.floorOf(snap)
	require.Same(t, &f1[0], &f2[0], "the same snapshot and databases: the same entries")
	require.Equal(t, len(f1), cap(f1), "shared entries are clipped: an append copies")

	// b's primary was observed longer ago than the staleness bound: its
	// epoch is not known to be current, so it reads the primary.
	clock = now.Add(600 * time.Millisecond)
	require.Equal(t, want[:1], m.floorOf(snap))
	clock = now
	require.Equal(t, want, m.floorOf(snap))

	// Another snapshot: made again from it.
	ep2 := position.Epoch{SystemID: 7, Timeline: 2}
	next := &replay.Snapshot{Databases: []replay.DatabaseState{
		{Name: "a", Primary: replay.PrimaryState{Epoch: ep2, ObservedAt: now}},
		{Name: "b"},
	}}
	require.Equal(t, []position.Entry{{Database: "a", Epoch: ep2}}, m.floorOf(next))

	// A token that names a database gets the floor of the others only.
	tok := position.New("a", ep, 42, position.SourcePrimary, now)
	got := m.jobToken(carried{tok: tok}, snap, now)
	require.Equal(t, []position.Entry{tok.Entries[0], {Database: "b", Epoch: ep}}, got.Entries)
	require.Len(t, m.floorOf(snap), 2, "unchanged by a session's token")
}
