package consume

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// Diverged standbys and restarted replicas in Decide: a standby left on
// the old timeline past the switchpoint is used for no token and waited
// on by none; a restarted replica is behind every token until it passes
// its RestartFloor.
func TestDecideReplicaConditions(t *testing.T) {
	t.Parallel()
	hist := position.History{{Timeline: 1, Switchpoint: lsn("0/5000000")}}
	// divergent: on timeline 1, past the switchpoint of timeline 2.
	divergent := rep("old", 1, "0/5800000")
	following := rep("new", 2, "0/6000000")
	heldBelow := func(floor string) func(*replay.ReplicaState) {
		return func(r *replay.ReplicaState) { r.RestartFloor = lsn(floor) }
	}
	oldTok := tok(0, ent("main", 1, "0/4000000"))  // shared history
	lateTok := tok(0, ent("main", 1, "0/5400000")) // past the switchpoint: not in the new history
	newTok := tok(0, ent("main", 2, "0/5900000"))

	cases := []decideCase{
		{
			name:   "old-timeline token does not read the diverged standby",
			in:     DecideInput{Policy: Delayed, Token: oldTok, Snapshot: snap(dbState("main", 2, hist, divergent))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonDivergedStandby, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonDivergedStandby}},
		},
		{
			name:   "new-timeline token does not wait on the diverged standby",
			in:     DecideInput{Policy: Delayed, Token: newTok, Snapshot: snap(dbState("main", 2, hist, divergent))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonDivergedStandby, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonDivergedStandby}},
		},
		{
			name:   "token past the switchpoint reads the primary (epoch)",
			in:     DecideInput{Policy: Delayed, Token: lateTok, Snapshot: snap(dbState("main", 2, hist, divergent))},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"main", "", OutcomePrimaryEpoch, ReasonEpoch}},
		},
		{
			name:   "old-timeline token reads the replica that follows the new timeline",
			in:     DecideInput{Policy: Sticky, Token: oldTok, Snapshot: snap(dbState("main", 2, hist, divergent, following))},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "new", OutcomeReplica, ReasonNone}},
		},
		{
			name: "new-timeline token waits only on the replica that can catch up",
			in: DecideInput{Policy: Delayed, Token: tok(0, ent("main", 2, "0/7000000")),
				Snapshot: snap(dbState("main", 2, hist, divergent, following))},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"main", "", outcomeWait, ReasonReplicaBehind}},
		},
		{
			name: "diverged and failing: the diverged standby names the reason",
			in: DecideInput{Policy: Sticky, Token: oldTok,
				Snapshot: snap(dbState("main", 2, hist, divergent, rep("new", 2, "0/6000000", failing)))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonDivergedStandby, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonDivergedStandby}},
		},
		{
			// Diverged counts as a fallback: the cap applies as for no
			// healthy replica, and a capped delayed job defers.
			name: "diverged standby, fallback capped: a delayed job defers",
			in: DecideInput{Policy: Delayed, Token: newTok, Capped: true,
				Snapshot: snap(dbState("main", 2, hist, divergent))},
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonCapped, delay: time.Second,
			dbs: []wantDB{{"main", "", OutcomeDeferred, ReasonDivergedStandby}},
		},
		{
			name: "history unknown: divergence cannot be seen, old tokens read the primary anyway",
			in: DecideInput{Policy: Delayed, Token: oldTok,
				Snapshot: snap(dbState("main", 2, nil, divergent))},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"main", "", OutcomePrimaryEpoch, ReasonEpoch}},
		},
		{
			name: "restarted replica is behind a token it has replayed",
			in: DecideInput{Policy: Delayed, Token: tok(0, ent("main", 1, "0/2000000")),
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", heldBelow("0/3800000"))))},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"main", "", outcomeWait, ReasonReplicaRestarted}},
		},
		{
			name: "restarted replica, sticky reads the primary",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/2000000")),
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", heldBelow("0/3800000"))))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonReplicaBehind, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonReplicaBehind}},
		},
		{
			name: "restarted replica past its floor is used",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/2000000")),
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/3800000", heldBelow("0/3800000"))))},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "another caught-up replica serves while one is held",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/2000000")),
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", heldBelow("0/3800000")), rep("r2", 1, "0/2000000")))},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r2", OutcomeReplica, ReasonNone}},
		},
	}
	runDecideCases(t, cases)
}

func TestReasonNames(t *testing.T) {
	t.Parallel()
	require.Equal(t, "diverged_standby", ReasonDivergedStandby.String())
	require.Equal(t, "replica_restarted", ReasonReplicaRestarted.String())
	require.True(t, ReasonDivergedStandby.fallback())
}
