package replicapool

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Failures make an exclusion, with one transition at its start, that
// failed re-probes grow to MaxExclusion; an exclusion for unreachability that ran
// out holds until a re-probe succeeds, and a failed re-probe grows it.
func TestHealthExclusionGrowsAndReprobes(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	var h health
	boom := errors.New("reset")

	tr, until := h.fail(t0, ReasonUnreachable, boom)
	require.Equal(t, excludedNow, tr)
	require.Equal(t, t0.Add(ExclusionBase), until)
	excluded, err, reprobe, _ := h.state(t0.Add(500 * time.Millisecond))
	require.True(t, excluded)
	require.ErrorIs(t, err, boom)
	require.False(t, reprobe)

	// A failure during the exclusion (a job routed before it) is part of
	// it: no transition, no growth.
	tr, again := h.fail(t0.Add(600*time.Millisecond), ReasonUnreachable, boom)
	require.Equal(t, noTransition, tr)
	require.Equal(t, until, again)

	// Run out: one caller starts the re-probe, the replica stays out.
	at := until.Add(time.Millisecond)
	excluded, _, reprobe, _ = h.state(at)
	require.True(t, excluded)
	require.True(t, reprobe)
	excluded, _, reprobe, _ = h.state(at)
	require.True(t, excluded, "out while the re-probe runs")
	require.False(t, reprobe, "one re-probe at a time")

	// Failed re-probes grow the exclusion up to its bound.
	var last time.Duration
	for i := 0; i < 10; i++ {
		u := h.reprobeFailed(at, boom)
		last = u.Sub(at)
		excluded, _, reprobe, _ = h.state(u)
		require.True(t, excluded)
		require.True(t, reprobe)
		at = u
	}
	require.Equal(t, MaxExclusion, last)

	require.Equal(t, readmitted, h.succeeded())
	excluded, _, _, _ = h.state(at)
	require.False(t, excluded)
	// Failures are remembered: the next one soon after is left out longer
	// than a first one.
	_, until = h.fail(at.Add(time.Second), ReasonUnreachable, boom)
	require.Equal(t, MaxExclusion, until.Sub(at.Add(time.Second)))
	// And forgotten after a quiet spell.
	h = health{}
	h.fail(t0, ReasonUnreachable, boom)
	h.succeeded()
	_, until = h.fail(t0.Add(forgetAfter+time.Second), ReasonUnreachable, boom)
	require.Equal(t, ExclusionBase, until.Sub(t0.Add(forgetAfter+time.Second)))
}

// An exclusion for lag runs out by itself (lag is the job's to judge), and
// a successful connection does not end it early.
func TestHealthBehindLapses(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	var h health
	tr, until := h.fail(t0, ReasonBehind, ErrReplicaBehind)
	require.Equal(t, excludedNow, tr)
	require.Equal(t, noTransition, h.succeeded(), "reachable is not caught up")
	excluded, _, _, _ := h.state(until.Add(-time.Millisecond))
	require.True(t, excluded)
	excluded, _, reprobe, tr := h.state(until)
	require.False(t, excluded)
	require.False(t, reprobe)
	require.Equal(t, readmitted, tr)
	// Unreachable wins over behind: it needs the re-probe.
	h = health{}
	h.fail(t0, ReasonBehind, ErrReplicaBehind)
	h.fail(t0, ReasonUnreachable, ErrUnreachable)
	h.fail(t0, ReasonBehind, ErrReplicaBehind)
	_, err, _, _ := h.state(t0)
	require.ErrorIs(t, err, ErrUnreachable)
}

// A job that met only lagging servers leaves the replica in; BehindRun of
// them in a row, with no job served between, leave it out; one served job
// starts the count again.
func TestBehindRun(t *testing.T) {
	var b behindRun
	for range BehindRun - 1 {
		require.False(t, b.failed())
	}
	b.reset()
	for i := range BehindRun - 1 {
		require.False(t, b.failed(), "job %d after a served one", i+1)
	}
	require.True(t, b.failed(), "BehindRun in a row")
	require.True(t, b.failed(), "and more")
}
