package consume

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
)

// TestDecideVerified: what a Verifier found (DecideInput.Verified) only
// ever takes replicas away. A bound makes every replica at or below it
// behind (the job waits, defers or reads the primary as for lag), and
// one that has replayed past it a candidate again; an unknown verdict
// sends the entry to the primary as a fallback (capped like lag).
func TestDecideVerified(t *testing.T) {
	t.Parallel()
	// r1 at 0/3000000, r2 at 0/2000000; the entry at 0/1800000 is caught
	// up on both as far as positions go.
	main := dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/2000000"))
	tk := tok(time.Second, ent("main", 1, "0/1800000"))
	in := func(pol Policy, vc ...EntryCheck) DecideInput {
		return DecideInput{Policy: pol, Token: tk, Snapshot: snap(main), Now: t0, Verified: vc}
	}

	cases := []struct {
		name     string
		in       DecideInput
		action   Action
		outcome  Outcome
		reason   Reason
		replica  string
		fallback bool
	}{
		{name: "nothing found", in: in(Delayed), action: ActionRun, outcome: OutcomeReplica, replica: "r1"},
		{name: "empty check", in: in(Delayed, EntryCheck{}), action: ActionRun, outcome: OutcomeReplica, replica: "r1"},
		{
			name: "bound below one replica", in: in(Delayed, EntryCheck{After: lsn("0/2000000")}),
			action: ActionRun, outcome: OutcomeReplica, replica: "r1",
		},
		{
			name: "bound at the best replica: wait", in: in(Delayed, EntryCheck{After: lsn("0/3000000")}),
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
		},
		{
			name: "bound past every replica, sticky: primary", in: in(Sticky, EntryCheck{After: lsn("0/3000000")}),
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonReplicaBehind, fallback: true,
		},
		{
			name: "unknown: primary at once", in: in(Delayed, EntryCheck{Unknown: true}),
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonUnverified, fallback: true,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := Decide(tc.in)
			require.Equal(t, tc.action, d.Action, "%+v", d)
			require.Equal(t, tc.outcome, d.Outcome)
			require.Equal(t, tc.reason, d.Reason)
			require.Equal(t, tc.fallback, d.Fallback)
			require.Len(t, d.Databases, 1)
			require.Equal(t, tc.replica, d.Databases[0].Replica)
		})
	}

	t.Run("bound past every replica, no wait left: deferred", func(t *testing.T) {
		x := in(Delayed, EntryCheck{After: lsn("0/3000000")})
		x.NoWait = true
		d := Decide(x)
		require.Equal(t, ActionDefer, d.Action)
		require.Equal(t, OutcomeDeferred, d.Outcome)
		require.Equal(t, uint64(1), d.Databases[0].BytesBehind, "r1 must pass the bound by one byte")
	})
	t.Run("unknown under the cap: deferred", func(t *testing.T) {
		x := in(Delayed, EntryCheck{Unknown: true})
		x.Capped = true
		d := Decide(x)
		require.Equal(t, ActionDefer, d.Action)
		require.Equal(t, ReasonCapped, d.Reason)
	})
	t.Run("a second entry keeps its own check", func(t *testing.T) {
		other := dbState("other", 1, nil, rep("o1", 1, "0/3000000"))
		x := DecideInput{Policy: Delayed, Snapshot: snap(main, other), Now: t0,
			Token:    tok(time.Second, ent("main", 1, "0/1800000"), ent("other", 1, "0/1000000")),
			Verified: []EntryCheck{{}, {Unknown: true}}}
		d := Decide(x)
		main, _ := d.Database("main")
		oth, _ := d.Database("other")
		require.Equal(t, "r1", main.Replica)
		require.Equal(t, ReasonUnverified, oth.Reason)
		require.Equal(t, OutcomePrimary, d.Outcome)
	})
}

// TestReadPositions: the child token of a verified job names only the
// databases read on a replica, at what the tracker saw there.
func TestReadPositions(t *testing.T) {
	t.Parallel()
	d := Decision{Databases: []DatabaseDecision{
		{Database: "main", replica: 0, ReadAt: position.Replayed{Epoch: ep(1), LSN: lsn("0/3000000")}},
		{Database: "other", replica: -1},
	}}
	tk := readPositions(&d, t0)
	require.Len(t, tk.Entries, 1)
	e, ok := tk.Entry("main")
	require.True(t, ok)
	require.Equal(t, lsn("0/3000000"), e.LSN)
	require.Equal(t, position.SourceReplica, e.Source)
	require.Equal(t, t0, tk.CapturedAt)
	require.True(t, readPositions(&Decision{Databases: []DatabaseDecision{{replica: -1}}}, t0).IsZero())
}
