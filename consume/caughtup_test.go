package consume

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// TestCaughtUp: a token is caught up exactly when Decide would put every
// database it names on a replica; unknown is never caught up.
func TestCaughtUp(t *testing.T) {
	t.Parallel()
	hist := position.History{{Timeline: 1, Switchpoint: lsn("0/5000000")}}
	main := dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/2000000"))
	other := dbState("other", 1, nil, rep("o1", 1, "0/1000000"))
	held := func(r *replay.ReplicaState) { r.RestartFloor = lsn("0/4000000") }

	cases := []struct {
		name string
		tok  position.Token
		s    *replay.Snapshot
		want bool
	}{
		{"below the furthest replica", tok(0, ent("main", 1, "0/2800000")), snap(main), true},
		{"exactly at a replica", tok(0, ent("main", 1, "0/3000000")), snap(main), true},
		{"past every replica", tok(0, ent("main", 1, "0/3000001")), snap(main), false},
		{"zero token", position.Token{}, snap(main), false},
		{"nil snapshot", tok(0, ent("main", 1, "0/100")), nil, false},
		{"unknown database", tok(0, ent("billing", 1, "0/100")), snap(main), false},
		{"database without replicas", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil)), false},
		{"every database caught up", tok(0, ent("main", 1, "0/2000000"), ent("other", 1, "0/1000000")), snap(main, other), true},
		{"one database behind", tok(0, ent("main", 1, "0/2000000"), ent("other", 1, "0/1000001")), snap(main, other), false},
		{"one database unknown", tok(0, ent("main", 1, "0/2000000"), ent("zzz", 1, "0/1")), snap(main, other), false},
		{"stale replica", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", stale))), false},
		{"failing replica", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", failing))), false},
		{"unhealthy replica", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", unhealthy))), false},
		{"promoted replica", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", promoted))), false},
		{"replica epoch unknown", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", noEpoch))), false},
		{"replica position NULL", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", nullLSN))), false},
		{"one of two unusable, the other caught up", tok(0, ent("main", 1, "0/100")),
			snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", failing), rep("r2", 1, "0/200"))), true},
		{"held after a restart", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", held))), false},
		{"past its restart floor", tok(0, ent("main", 1, "0/100")), snap(dbState("main", 1, nil, rep("r1", 1, "0/4000000", held))), true},
		{"token of another system", position.New("main", position.Epoch{SystemID: 42, Timeline: 1}, lsn("0/100"), position.SourcePrimary, t0), snap(main), false},
		{"token without epoch", position.New("main", position.Epoch{}, lsn("0/100"), position.SourcePrimary, t0), snap(main), false},
		{"older timeline within the switchpoint", tok(0, ent("main", 1, "0/4000000")), snap(dbState("main", 2, hist, rep("r1", 2, "0/6000000"))), true},
		{"older timeline past the switchpoint", tok(0, ent("main", 1, "0/5800000")), snap(dbState("main", 2, hist, rep("r1", 2, "0/6000000"))), false},
		{"older timeline, history unknown", tok(0, ent("main", 1, "0/4000000")), snap(dbState("main", 2, nil, rep("r1", 2, "0/6000000"))), false},
		{"newer timeline than the replica", tok(0, ent("main", 2, "0/5100000")), snap(dbState("main", 2, hist, rep("r1", 1, "0/5000000"))), false},
		{"diverged standby", tok(0, ent("main", 1, "0/4000000")), snap(dbState("main", 2, hist, rep("old", 1, "0/5800000"))), false},
		{"primary unknown, replica decides", tok(0, ent("main", 1, "0/2800000")),
			snap(replay.DatabaseState{Name: "main", Primary: replay.PrimaryState{Err: errors.New("down")}, Replicas: main.Replicas}), true},
		{"token age does not matter", tok(time.Hour, ent("main", 1, "0/2800000")), snap(main), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, CaughtUp(tc.tok, tc.s, t0, nil))
			// Exactly the replicas Decide routes to: every database of
			// the token on a replica, whatever the policy that lets a
			// replica serve it.
			for _, pol := range []Policy{Sticky, Delayed} {
				d := Decide(DecideInput{Policy: pol, Token: tc.tok, Snapshot: tc.s, Now: t0})
				onReplicas := len(d.Databases) > 0 && d.Action == ActionRun
				for _, dd := range d.Databases {
					onReplicas = onReplicas && dd.Replica != ""
				}
				require.Equal(t, tc.want, onReplicas, "Decide(%s): %s %s", pol, d.Outcome, d.Reason)
			}
		})
	}
}

// TestCaughtUpDoesNotAllocate: the asynq adapter checks every remembered
// task's token on every snapshot.
func TestCaughtUpDoesNotAllocate(t *testing.T) {
	s := snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/2000000")))
	tk := tok(0, ent("main", 1, "0/2800000"))
	cfg := Config{}.WithDefaults()
	require.Zero(t, testing.AllocsPerRun(100, func() { CaughtUp(tk, s, t0, &cfg) }))
}

// TestWaitCaughtUp on the real cluster: with every replica paused a
// written token is not caught up, WaitCaughtUp watches both replicas
// (polled fast) and ends with its context; after resume it returns as
// soon as the tracker sees a replica past the token, and the watch ends.
func TestWaitCaughtUp(t *testing.T) {
	c := pgtest.Shared(t)
	e := setup(t, c)
	r := e.router(t)
	pauseAll(t, c)
	_, tk := e.write(t)
	require.False(t, r.CaughtUp(tk))

	short, cancel := context.WithTimeout(ctxT(t), 50*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, r.WaitCaughtUp(short, tk), context.DeadlineExceeded)
	require.Zero(t, waiting(r), "the watch ends with the wait")

	// A follower records every snapshot it sees.
	var (
		mu    sync.Mutex
		snaps []*replay.Snapshot
	)
	follow, stopFollow := context.WithCancel(context.Background())
	followed := make(chan struct{})
	go func() {
		defer close(followed)
		for {
			s := r.Snapshot()
			mu.Lock()
			snaps = append(snaps, s)
			mu.Unlock()
			select {
			case <-s.Changed():
			case <-follow.Done():
				return
			}
		}
	}()

	done := make(chan error, 1)
	go func() { done <- r.WaitCaughtUp(context.Background(), tk) }()
	waitUntil(t, r, "the wait watches both replicas", func(*replay.Snapshot) bool { return waiting(r) == 2 })
	resumed := time.Now()
	resumeAll(t, c)
	require.NoError(t, <-done)
	returned := time.Now()
	require.True(t, r.CaughtUp(tk))
	require.Zero(t, waiting(r), "the watch ends with the wait")
	stopFollow()
	<-followed

	mu.Lock()
	defer mu.Unlock()
	// The follower saw the catch-up, in a snapshot made after the resume.
	var at time.Time
	for _, s := range snaps {
		if now := newestObservation(s); CaughtUp(tk, s, now, &r.cfg) {
			at = now
			break
		}
	}
	require.False(t, at.IsZero(), "the follower saw the token caught up")
	require.True(t, at.After(resumed), "caught up %v before the resume", resumed.Sub(at))
	t.Logf("resume → caught up (tracker observation %v), → WaitCaughtUp returned %v; %d snapshots followed",
		at.Sub(resumed), returned.Sub(resumed), len(snaps))

	// Watch is idempotent to stop and speeds up only while held.
	stop := r.Watch(tk)
	require.Equal(t, 2, waiting(r))
	stop()
	stop()
	require.Zero(t, waiting(r))
}

// newestObservation is the latest ObservedAt in s: the snapshot was
// published right after the observation that made it.
func newestObservation(s *replay.Snapshot) time.Time {
	var t time.Time
	for i := range s.Databases {
		ds := &s.Databases[i]
		if ds.Primary.ObservedAt.After(t) {
			t = ds.Primary.ObservedAt
		}
		for j := range ds.Replicas {
			if o := ds.Replicas[j].ObservedAt; o.After(t) {
				t = o
			}
		}
	}
	return t
}
