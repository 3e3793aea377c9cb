package consume

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

const sysID = 0x6f1e2d3c4b5a6978

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func ep(tli uint32) position.Epoch { return position.Epoch{SystemID: sysID, Timeline: tli} }

func lsn(s string) position.LSN { return position.MustParseLSN(s) }

// rep is a healthy replica in recovery, observed just now.
func rep(name string, tli uint32, at string, mods ...func(*replay.ReplicaState)) replay.ReplicaState {
	r := replay.ReplicaState{
		Name:         name,
		Replayed:     position.Replayed{Epoch: ep(tli), LSN: lsn(at)},
		InRecovery:   true,
		Healthy:      true,
		ObservedAt:   t0.Add(-10 * time.Millisecond),
		Observations: 1,
	}
	for _, m := range mods {
		m(&r)
	}
	return r
}

func dbState(name string, primaryTLI uint32, hist position.History, replicas ...replay.ReplicaState) replay.DatabaseState {
	return replay.DatabaseState{
		Name: name,
		Primary: replay.PrimaryState{
			Epoch: ep(primaryTLI), History: hist, HistoryKnown: primaryTLI == 1 || hist != nil,
			InsertLSN: lsn("0/9000000"), ObservedAt: t0.Add(-20 * time.Millisecond),
		},
		Replicas: replicas,
	}
}

func snap(dbs ...replay.DatabaseState) *replay.Snapshot { return &replay.Snapshot{Databases: dbs} }

func ent(db string, tli uint32, at string) position.Entry {
	return position.Entry{Database: db, Epoch: ep(tli), LSN: lsn(at), Source: position.SourcePrimary}
}

// tok is captured age before t0.
func tok(age time.Duration, entries ...position.Entry) position.Token {
	return position.Of(t0.Add(-age), entries...)
}

var (
	stale     = func(r *replay.ReplicaState) { r.ObservedAt = t0.Add(-2 * time.Second) }
	failing   = func(r *replay.ReplicaState) { r.Err = errors.New("connection refused") }
	unhealthy = func(r *replay.ReplicaState) { r.Healthy = false }
	promoted  = func(r *replay.ReplicaState) { r.InRecovery = false }
	noEpoch   = func(r *replay.ReplicaState) { r.Replayed.Epoch = position.Epoch{} }
	nullLSN   = func(r *replay.ReplicaState) { r.Replayed.LSN = 0 }
)

type wantDB struct {
	db      string
	replica string
	outcome Outcome
	reason  Reason
}

func TestDecide(t *testing.T) {
	t.Parallel()
	hist := position.History{{Timeline: 1, Switchpoint: lsn("0/5000000")}}
	// main: two replicas, r1 at 0/3000000 and r2 at 0/2000000 on timeline 1.
	main := dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/2000000"))
	caught := tok(0, ent("main", 1, "0/2800000"))
	behind := tok(0, ent("main", 1, "0/3800000"))

	cases := []decideCase{
		{
			name: "no token", in: DecideInput{Policy: Sticky, Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomePrimaryNoToken, reason: ReasonNoToken,
		},
		{
			name: "malformed token", in: DecideInput{Policy: Delayed, TokenErr: position.ErrMalformed, Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomePrimaryNoToken, reason: ReasonMalformedToken,
		},
		{
			name: "policy always", in: DecideInput{Policy: Always, Token: caught, Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonPolicyAlways,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonPolicyAlways}},
		},
		{
			name: "caught up sticky", in: DecideInput{Policy: Sticky, Token: caught, Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "default policy is delayed", in: DecideInput{Token: behind, Snapshot: snap(main)},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"main", "", outcomeWait, ReasonReplicaBehind}},
		},
		{
			name: "caught up after waiting", in: DecideInput{Policy: Delayed, Token: caught, Snapshot: snap(main), Waited: true},
			action: ActionRun, outcome: OutcomeReplicaWaited, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplicaWaited, ReasonNone}},
		},
		{
			name: "exactly at the token is caught up", in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/3000000")), Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "foreign system id", in: DecideInput{Policy: Delayed, Token: position.New("main", position.Epoch{SystemID: 42, Timeline: 1}, lsn("0/100"), position.SourcePrimary, t0), Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"main", "", OutcomePrimaryEpoch, ReasonEpoch}},
		},
		{
			name: "unknown token epoch", in: DecideInput{Policy: Delayed, Token: position.New("main", position.Epoch{}, lsn("0/100"), position.SourcePrimary, t0), Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"main", "", OutcomePrimaryEpoch, ReasonEpoch}},
		},
		{
			name: "older timeline within switchpoint",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/4000000")),
				Snapshot: snap(dbState("main", 2, hist, rep("r1", 2, "0/6000000")))},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "older timeline at switchpoint",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/5000000")),
				Snapshot: snap(dbState("main", 2, hist, rep("r1", 2, "0/6000000")))},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "older timeline past switchpoint",
			in: DecideInput{Policy: Delayed, Token: tok(0, ent("main", 1, "0/5800000")),
				Snapshot: snap(dbState("main", 2, hist, rep("r1", 2, "0/6000000")))},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"main", "", OutcomePrimaryEpoch, ReasonEpoch}},
		},
		{
			name: "older timeline, history unknown",
			in: DecideInput{Policy: Delayed, Token: tok(0, ent("main", 1, "0/4000000")),
				Snapshot: snap(dbState("main", 2, nil, rep("r1", 2, "0/6000000")))},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"main", "", OutcomePrimaryEpoch, ReasonEpoch}},
		},
		{
			name: "token from a timeline the router's primary does not have waits",
			in: DecideInput{Policy: Delayed, Token: tok(0, ent("main", 2, "0/100")),
				Snapshot: snap(main)},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"main", "", outcomeWait, ReasonPrimaryBehind}},
		},
		{
			name: "token from a timeline the router's primary does not have: sticky is refused, never the primary",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 2, "0/100")),
				Snapshot: snap(main)},
			action: ActionRefuse, outcome: OutcomeRefused, reason: ReasonPrimaryBehind, delay: time.Second,
			dbs: []wantDB{{"main", "", OutcomeRefused, ReasonPrimaryBehind}},
		},
		{
			name: "token from a timeline the router's primary does not have: delayed past its wait defers",
			in: DecideInput{Policy: Delayed, Token: tok(0, ent("main", 2, "0/100")), NoWait: true,
				Snapshot: snap(main)},
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonReplicaBehind, delay: time.Second,
			dbs: []wantDB{{"main", "", OutcomeDeferred, ReasonPrimaryBehind}},
		},
		{
			name: "token from a timeline the router's primary does not have: a replica on it that has replayed it serves it",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 2, "0/5100000")),
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 2, "0/6000000")))},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "replica not yet following the new timeline, delayed waits",
			in: DecideInput{Policy: Delayed, Token: tok(0, ent("main", 2, "0/5100000")),
				Snapshot: snap(dbState("main", 2, hist, rep("r1", 1, "0/5000000")))},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"main", "", outcomeWait, ReasonReplicaBehind}},
		},
		{
			name: "replica not yet following the new timeline, sticky promotes",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 2, "0/5100000")),
				Snapshot: snap(dbState("main", 2, hist, rep("r1", 1, "0/5000000")))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonReplicaBehind, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonReplicaBehind}},
		},
		{
			name: "primary unknown: replicas still decide",
			in: DecideInput{Policy: Sticky, Token: caught,
				Snapshot: snap(replay.DatabaseState{Name: "main", Primary: replay.PrimaryState{Err: errors.New("down")}, Replicas: main.Replicas})},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "primary unknown, replica of another system",
			in: DecideInput{Policy: Delayed, Token: caught,
				Snapshot: snap(replay.DatabaseState{Name: "main", Primary: replay.PrimaryState{Err: errors.New("down")},
					Replicas: []replay.ReplicaState{rep("r1", 1, "0/9000000", func(r *replay.ReplicaState) { r.Replayed.Epoch.SystemID = 7 })}})},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"main", "", OutcomePrimaryEpoch, ReasonEpoch}},
		},
		{
			name: "stale tracker",
			in: DecideInput{Policy: Delayed, Token: caught,
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", stale), rep("r2", 1, "0/3000000", stale)))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonTrackerStale, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonTrackerStale}},
		},
		{
			name: "one stale replica, other caught up",
			in: DecideInput{Policy: Sticky, Token: caught,
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", stale), rep("r2", 1, "0/3000000")))},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r2", OutcomeReplica, ReasonNone}},
		},
		{
			name: "never observed",
			in: DecideInput{Policy: Sticky, Token: caught,
				Snapshot: snap(dbState("main", 1, nil, replay.ReplicaState{Name: "r1"}))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonTrackerStale, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonTrackerStale}},
		},
		{
			name: "no healthy replica: failing, unhealthy, unknown epoch, NULL position",
			in: DecideInput{Policy: Sticky, Token: caught,
				Snapshot: snap(dbState("main", 1, nil,
					rep("r1", 1, "0/9000000", failing), rep("r2", 1, "0/9000000", unhealthy),
					rep("r3", 1, "0/9000000", noEpoch), rep("r4", 1, "0/9000000", nullLSN)))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonNoHealthyReplica, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonNoHealthyReplica}},
		},
		{
			name: "no healthy replica, delayed goes to the primary at once",
			in: DecideInput{Policy: Delayed, Token: caught,
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", failing)))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonNoHealthyReplica, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonNoHealthyReplica}},
		},
		{
			name: "replica left recovery is skipped",
			in: DecideInput{Policy: Sticky, Token: caught,
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", promoted), rep("r2", 1, "0/3000000")))},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r2", OutcomeReplica, ReasonNone}},
		},
		{
			name: "only replica left recovery",
			in: DecideInput{Policy: Sticky, Token: caught,
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", promoted)))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonNoHealthyReplica, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonNoHealthyReplica}},
		},
		{
			name:   "all behind, sticky promotes",
			in:     DecideInput{Policy: Sticky, Token: behind, Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonReplicaBehind, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonReplicaBehind}},
		},
		{
			name:   "all behind, delayed waits",
			in:     DecideInput{Policy: Delayed, Token: behind, Snapshot: snap(main)},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"main", "", outcomeWait, ReasonReplicaBehind}},
		},
		{
			name:   "all behind, delayed after the wait defers",
			in:     DecideInput{Policy: Delayed, Token: behind, Snapshot: snap(main), Waited: true, NoWait: true},
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonReplicaBehind, delay: time.Second,
			dbs: []wantDB{{"main", "", OutcomeDeferred, ReasonReplicaBehind}},
		},
		{
			name:   "deferral grows with age",
			in:     DecideInput{Policy: Delayed, Token: tok(10*time.Second, ent("main", 1, "0/3800000")), Snapshot: snap(main), NoWait: true},
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonReplicaBehind, delay: 8 * time.Second,
			dbs: []wantDB{{"main", "", OutcomeDeferred, ReasonReplicaBehind}},
		},
		{
			name:   "deferral ends at max age",
			in:     DecideInput{Policy: Delayed, Token: tok(115*time.Second, ent("main", 1, "0/3800000")), Snapshot: snap(main), NoWait: true},
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonReplicaBehind, delay: 5 * time.Second,
			dbs: []wantDB{{"main", "", OutcomeDeferred, ReasonReplicaBehind}},
		},
		{
			name:   "all behind, a job that cannot be deferred reads the primary after the wait, charged",
			in:     DecideInput{Policy: Delayed, Token: behind, Snapshot: snap(main), Waited: true, NoWait: true, NoDefer: true},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonCannotDefer, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonCannotDefer}},
		},
		{
			name:   "a job that cannot be deferred still waits first",
			in:     DecideInput{Policy: Delayed, Token: behind, Snapshot: snap(main), NoDefer: true},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"main", "", outcomeWait, ReasonReplicaBehind}},
		},
		{
			name: "a deferral that would end after DeferBy is not made",
			in: DecideInput{Policy: Delayed, Token: tok(10*time.Second, ent("main", 1, "0/3800000")), Snapshot: snap(main), NoWait: true,
				Now: t0, DeferBy: t0.Add(7 * time.Second)},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonCannotDefer, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonCannotDefer}},
		},
		{
			name: "a deferral that ends by DeferBy is made",
			in: DecideInput{Policy: Delayed, Token: tok(10*time.Second, ent("main", 1, "0/3800000")), Snapshot: snap(main), NoWait: true,
				Now: t0, DeferBy: t0.Add(8 * time.Second)},
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonReplicaBehind, delay: 8 * time.Second,
			dbs: []wantDB{{"main", "", OutcomeDeferred, ReasonReplicaBehind}},
		},
		{
			name:   "cap exhausted, a delayed job that cannot be deferred is refused",
			in:     DecideInput{Policy: Delayed, Token: behind, Snapshot: snap(main), NoWait: true, NoDefer: true, Capped: true},
			action: ActionRefuse, outcome: OutcomeCapped, reason: ReasonCapped, delay: time.Second,
			dbs: []wantDB{{"main", "", OutcomeCapped, ReasonCannotDefer}},
		},
		{
			name:   "delayed past max age goes to the primary without waiting",
			in:     DecideInput{Policy: Delayed, Token: tok(2*time.Minute, ent("main", 1, "0/3800000")), Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonDeadline, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonDeadline}},
		},
		{
			name:   "delayed past max age still prefers a caught-up replica",
			in:     DecideInput{Policy: Delayed, Token: tok(time.Hour, ent("main", 1, "0/100")), Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name:   "unknown age waits",
			in:     DecideInput{Policy: Delayed, Token: position.Of(time.Time{}, ent("main", 1, "0/3800000")), Snapshot: snap(main)},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"main", "", outcomeWait, ReasonReplicaBehind}},
		},
		{
			name:   "unknown age is never deferred",
			in:     DecideInput{Policy: Delayed, Token: position.Of(time.Time{}, ent("main", 1, "0/3800000")), Snapshot: snap(main), NoWait: true},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonUnknownAge, fallback: true,
			dbs: []wantDB{{"main", "", OutcomePrimary, ReasonUnknownAge}},
		},
		{
			name:   "cap exhausted, sticky is capped",
			in:     DecideInput{Policy: Sticky, Token: behind, Snapshot: snap(main), Capped: true},
			action: ActionRefuse, outcome: OutcomeCapped, reason: ReasonCapped, delay: time.Second,
			dbs: []wantDB{{"main", "", OutcomeCapped, ReasonReplicaBehind}},
		},
		{
			name: "cap exhausted, delayed defers",
			in: DecideInput{Policy: Delayed, Token: caught, Capped: true,
				Snapshot: snap(dbState("main", 1, nil, rep("r1", 1, "0/9000000", failing)))},
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonCapped, delay: time.Second,
			dbs: []wantDB{{"main", "", OutcomeDeferred, ReasonNoHealthyReplica}},
		},
		{
			name:   "cap exhausted, delayed past max age is capped",
			in:     DecideInput{Policy: Delayed, Token: tok(3*time.Minute, ent("main", 1, "0/3800000")), Snapshot: snap(main), Capped: true},
			action: ActionRefuse, outcome: OutcomeCapped, reason: ReasonCapped, delay: 30 * time.Second,
			dbs: []wantDB{{"main", "", OutcomeCapped, ReasonDeadline}},
		},
		{
			name: "cap does not apply to epochs",
			in: DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/5800000")), Capped: true,
				Snapshot: snap(dbState("main", 2, hist, rep("r1", 2, "0/6000000")))},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"main", "", OutcomePrimaryEpoch, ReasonEpoch}},
		},
		{
			name:   "cap does not apply to caught-up jobs",
			in:     DecideInput{Policy: Sticky, Token: caught, Snapshot: snap(main), Capped: true},
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone,
			dbs: []wantDB{{"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "per database: one replica, one primary",
			in: DecideInput{Policy: Sticky,
				Token:    tok(0, ent("main", 1, "0/2800000"), ent("audit", 1, "0/7000000")),
				Snapshot: snap(dbState("audit", 1, nil, rep("a1", 1, "0/6000000")), main)},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonReplicaBehind, fallback: true,
			dbs: []wantDB{{"audit", "", OutcomePrimary, ReasonReplicaBehind}, {"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "per database: delayed waits for the job as a whole",
			in: DecideInput{Policy: Delayed,
				Token:    tok(0, ent("main", 1, "0/2800000"), ent("audit", 1, "0/7000000")),
				Snapshot: snap(dbState("audit", 1, nil, rep("a1", 1, "0/6000000")), main)},
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind,
			dbs: []wantDB{{"audit", "", outcomeWait, ReasonReplicaBehind}, {"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name: "per database: one replica, one cross-epoch",
			in: DecideInput{Policy: Delayed,
				Token: position.Of(t0, ent("main", 1, "0/2800000"),
					position.Entry{Database: "audit", Epoch: position.Epoch{SystemID: 9, Timeline: 1}, LSN: 1}),
				Snapshot: snap(dbState("audit", 1, nil, rep("a1", 1, "0/6000000")), main)},
			action: ActionRun, outcome: OutcomePrimaryEpoch, reason: ReasonEpoch,
			dbs: []wantDB{{"audit", "", OutcomePrimaryEpoch, ReasonEpoch}, {"main", "r1", OutcomeReplica, ReasonNone}},
		},
		{
			name:   "unknown database",
			in:     DecideInput{Policy: Delayed, Token: tok(0, ent("nope", 1, "0/1")), Snapshot: snap(main)},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonUnknownDatabase,
			dbs: []wantDB{{"nope", "", OutcomePrimary, ReasonUnknownDatabase}},
		},
		{
			name:   "database without replicas",
			in:     DecideInput{Policy: Delayed, Token: tok(0, ent("solo", 1, "0/1")), Snapshot: snap(dbState("solo", 1, nil))},
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonNoReplicas,
			dbs: []wantDB{{"solo", "", OutcomePrimary, ReasonNoReplicas}},
		},
	}
	runDecideCases(t, cases)
}

// decideCase is one Decide input, at t0, and the decision it must give.
type decideCase struct {
	name     string
	in       DecideInput
	action   Action
	outcome  Outcome
	reason   Reason
	fallback bool
	delay    time.Duration
	dbs      []wantDB
}

// runDecideCases checks Decide's decision for each case, and that a
// replica read is never below the token.
func runDecideCases(t *testing.T, cases []decideCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			in := tc.in
			in.Now = t0
			d := Decide(in)
			require.Equal(t, tc.action, d.Action, "action")
			require.Equal(t, tc.outcome, d.Outcome, "outcome")
			require.Equal(t, tc.reason, d.Reason, "reason")
			require.Equal(t, tc.fallback, d.Fallback, "fallback")
			require.Equal(t, tc.delay, d.Delay, "delay")
			require.NotEqual(t, PolicyDefault, d.Policy)
			got := make([]wantDB, len(d.Databases))
			for i, dd := range d.Databases {
				got[i] = wantDB{dd.Database, dd.Replica, dd.Outcome, dd.Reason}
				if dd.Replica != "" {
					require.GreaterOrEqual(t, dd.ReadAt.LSN, dd.Entry.LSN, "a replica read is never below the token")
					require.GreaterOrEqual(t, dd.replica, int32(0))
				} else {
					require.Equal(t, int32(-1), dd.replica)
				}
			}
			if len(tc.dbs) == 0 {
				tc.dbs = []wantDB{}
			}
			require.Equal(t, tc.dbs, got)
		})
	}
}

func TestDecideReportsIncomparable(t *testing.T) {
	t.Parallel()
	hist := position.History{{Timeline: 1, Switchpoint: lsn("0/5000000")}}
	s := snap(dbState("main", 2, hist, rep("r1", 2, "0/6000000")))
	for _, c := range []struct {
		tok  position.Token
		want position.Incomparable
	}{
		{position.New("main", position.Epoch{SystemID: 1, Timeline: 2}, 1, position.SourcePrimary, t0), position.OtherSystem},
		{tok(0, ent("main", 1, "0/5800000")), position.PastSwitchpoint},
		{position.New("main", position.Epoch{}, 1, position.SourcePrimary, t0), position.UnknownEpoch},
	} {
		d := Decide(DecideInput{Policy: Sticky, Token: c.tok, Snapshot: s, Now: t0})
		require.Equal(t, ReasonEpoch, d.Reason)
		require.Equal(t, c.want, d.Databases[0].Incomparable, c.tok.String())
	}
}

func TestDecideSpreadsAcrossCaughtUpReplicas(t *testing.T) {
	t.Parallel()
	s := snap(dbState("main", 1, nil,
		rep("r1", 1, "0/3000000"), rep("r2", 1, "0/1000000"), rep("r3", 1, "0/3000000"), rep("r4", 1, "0/3000000")))
	tk := tok(0, ent("main", 1, "0/2000000"))
	counts := map[string]int{}
	for i := range uint32(300) {
		d := Decide(DecideInput{Policy: Sticky, Token: tk, Snapshot: s, Now: t0, Spread: i})
		require.Equal(t, OutcomeReplica, d.Outcome)
		counts[d.Databases[0].Replica]++
	}
	require.Equal(t, map[string]int{"r1": 100, "r3": 100, "r4": 100}, counts, "r2 is behind; the others share evenly")
}

func TestDecideStalenessBoundary(t *testing.T) {
	t.Parallel()
	cfg := Config{Tracker: replay.TrackerConfig{StalenessBound: time.Second}}.WithDefaults()
	s := snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", func(r *replay.ReplicaState) { r.ObservedAt = t0.Add(-time.Second) })))
	tk := tok(0, ent("main", 1, "0/1"))
	d := Decide(DecideInput{Policy: Sticky, Token: tk, Snapshot: s, Now: t0, Config: &cfg})
	require.Equal(t, OutcomeReplica, d.Outcome, "exactly at the bound is still fresh")
	d = Decide(DecideInput{Policy: Sticky, Token: tk, Snapshot: s, Now: t0.Add(time.Nanosecond), Config: &cfg})
	require.Equal(t, ReasonTrackerStale, d.Reason, "past the bound is unknown")
}

func TestDeferSchedule(t *testing.T) {
	t.Parallel()
	cfg := Config{}.WithDefaults()
	// Steps 1, 2, 4, 8, 16, 30, 30 … s start at ages 0, 1, 3, 7, 15, 31, 61 … s.
	for _, c := range []struct{ age, want time.Duration }{
		{0, time.Second},
		{999 * time.Millisecond, time.Second},
		{time.Second, 2 * time.Second},
		{3 * time.Second, 4 * time.Second},
		{14 * time.Second, 8 * time.Second},
		{15 * time.Second, 16 * time.Second},
		{31 * time.Second, 30 * time.Second},
		{100 * time.Second, 20 * time.Second}, // cut at MaxAge
		{119 * time.Second, time.Second},
	} {
		require.Equal(t, c.want, deferDelay(c.age, &cfg), "age %v", c.age)
	}
	flat := Config{DeferInitial: time.Second, DeferMultiplier: 1, DeferMax: 5 * time.Second}.WithDefaults()
	require.Equal(t, time.Second, deferStep(time.Hour, &flat), "a multiplier of 1 keeps the initial delay")
	big := Config{DeferInitial: time.Millisecond, DeferMax: time.Millisecond, MaxAge: 24 * time.Hour}.WithDefaults()
	require.Equal(t, time.Millisecond, deferStep(23*time.Hour, &big), "no walk of millions of steps")
}

func TestDecideDoesNotAllocate(t *testing.T) {
	s := snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/3000000")))
	cfg := Config{}.WithDefaults()
	buf := make([]DatabaseDecision, 0, 2)
	for name, tk := range map[string]position.Token{
		"caught up": tok(0, ent("main", 1, "0/2000000")),
		"behind":    tok(0, ent("main", 1, "0/4000000")),
	} {
		in := DecideInput{Policy: Delayed, Token: tk, Snapshot: s, Now: t0, Config: &cfg, Buf: buf, NoWait: true}
		allocs := testing.AllocsPerRun(100, func() { _ = Decide(in) })
		require.Zero(t, allocs, name)
	}
}

func BenchmarkDecide(b *testing.B) {
	s := snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/3000000")))
	cfg := Config{}.WithDefaults()
	for _, bc := range []struct {
		name string
		tok  position.Token
	}{
		{"caught_up", tok(0, ent("main", 1, "0/2000000"))},
		{"behind_defer", tok(5*time.Second, ent("main", 1, "0/4000000"))},
	} {
		b.Run(bc.name, func(b *testing.B) {
			buf := make([]DatabaseDecision, 0, 1)
			in := DecideInput{Policy: Delayed, Token: bc.tok, Snapshot: s, Now: t0, Config: &cfg, Buf: buf, NoWait: true}
			b.ReportAllocs()
			var d Decision
			for i := 0; b.Loop(); i++ {
				in.Spread = uint32(i)
				d = Decide(in)
			}
			if d.Action == ActionWait {
				b.Fatal(fmt.Sprint(d))
			}
		})
	}
}

func TestPolicyText(t *testing.T) {
	t.Parallel()
	for _, p := range []Policy{PolicyDefault, Always, Sticky, Delayed} {
		b, err := p.MarshalText()
		require.NoError(t, err)
		var q Policy
		require.NoError(t, q.UnmarshalText(b))
		require.Equal(t, p, q)
	}
	p, err := ParsePolicy(" Sticky ")
	require.NoError(t, err)
	require.Equal(t, Sticky, p)
	_, err = ParsePolicy("eventually")
	var pe *PolicyError
	require.ErrorAs(t, err, &pe)
	_, err = Policy(9).MarshalText()
	require.Error(t, err)
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	require.ErrorIs(t, Config{}.WithDefaults().Validate(), ErrInvalidConfig)
	cfg := Config{}.WithDefaults()
	require.Equal(t, Delayed, cfg.DefaultPolicy)
	require.Equal(t, time.Second, cfg.Tracker.StalenessBound)
	require.Equal(t, 3*time.Second, Config{Tracker: replay.TrackerConfig{PollInterval: time.Second}}.WithDefaults().Tracker.StalenessBound)
}

func TestDeferErrorIs(t *testing.T) {
	t.Parallel()
	var err error = &DeferError{Delay: time.Second, Decision: Decision{Outcome: OutcomeDeferred, Reason: ReasonReplicaBehind}}
	require.ErrorIs(t, err, ErrDeferred)
	require.NotErrorIs(t, err, ErrCapped)
	err = fmt.Errorf("wrapped: %w", &DeferError{Delay: time.Second, Decision: Decision{Outcome: OutcomeCapped, Reason: ReasonCapped}})
	require.ErrorIs(t, err, ErrDeferred)
	require.ErrorIs(t, err, ErrCapped)
	var de *DeferError
	require.ErrorAs(t, err, &de)
	require.True(t, de.Capped())
	require.Contains(t, err.Error(), "PrimaryRate")
}

func TestInsertPositionPastPageHeader(t *testing.T) {
	t.Parallel()
	// The replica has replayed up to the page boundary; the token is the
	// insert position after the next page's header.
	db := dbState("main", 1, nil, rep("r1", 1, "0/400E000"))
	db.Primary.WAL = position.WALLayout{MaxAlign: 8, BlockSize: 8192, SegmentSize: 16 << 20}
	d := Decide(DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/400E018")), Snapshot: snap(db), Now: t0})
	require.Equal(t, OutcomeReplica, d.Outcome)
	require.Equal(t, lsn("0/400E018"), d.Databases[0].Entry.LSN, "the decision reports the token as stamped")
	d = Decide(DecideInput{Policy: Sticky, Token: tok(0, ent("main", 1, "0/400E020")), Snapshot: snap(db), Now: t0})
	require.Equal(t, ReasonReplicaBehind, d.Reason)
}

func TestReplicasNamesPools(t *testing.T) {
	t.Parallel()
	var pools []*pgxpool.Pool
	for _, dsn := range []string{"postgres://u@db1:5433/x", "postgres://u@db2/x", "postgres://u@db1:5433/y"} {
		p, err := pgxpool.New(context.Background(), dsn)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		pools = append(pools, p)
	}
	got := replay.Replicas(pools...)
	require.Equal(t, []string{"db1:5433", "db2:5432", "replica-2"}, []string{got[0].Name, got[1].Name, got[2].Name})
	require.Same(t, pools[2], got[2].Pool)
}

// TestDecideClockSkew: a capture time ahead of the decision time counts
// as age 0 within Config.ClockSkewTolerance and as unknown beyond it, so
// a Delayed job whose position no replica has is never deferred on a
// future capture time.
func TestDecideClockSkew(t *testing.T) {
	t.Parallel()
	main := dbState("main", 1, nil, rep("r1", 1, "0/3000000"))
	ahead := func(skew time.Duration, at string) position.Token {
		return position.Of(t0.Add(skew), ent("main", 1, at))
	}
	const tol = DefaultClockSkewTolerance
	for _, c := range []struct {
		name     string
		tok      position.Token
		policy   Policy
		noWait   bool
		capped   bool
		action   Action
		outcome  Outcome
		reason   Reason
		delay    time.Duration
		age      time.Duration
		skew     time.Duration
		fallback bool
	}{
		{name: "in the past", tok: ahead(-10*time.Second, "0/4000000"), policy: Delayed, noWait: true,
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonReplicaBehind, delay: 8 * time.Second, age: 10 * time.Second},
		{name: "ahead within the tolerance is age 0", tok: ahead(time.Second, "0/4000000"), policy: Delayed, noWait: true,
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonReplicaBehind, delay: time.Second},
		{name: "exactly the tolerance ahead is age 0", tok: ahead(tol, "0/4000000"), policy: Delayed, noWait: true,
			action: ActionDefer, outcome: OutcomeDeferred, reason: ReasonReplicaBehind, delay: time.Second},
		{name: "past the tolerance: waits first", tok: ahead(tol+time.Nanosecond, "0/4000000"), policy: Delayed,
			action: ActionWait, outcome: outcomeWait, reason: ReasonReplicaBehind, skew: tol + time.Nanosecond},
		{name: "past the tolerance: primary after the wait, not deferred", tok: ahead(tol+time.Nanosecond, "0/4000000"), policy: Delayed, noWait: true,
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonUnknownAge, skew: tol + time.Nanosecond, fallback: true},
		{name: "an hour ahead", tok: ahead(time.Hour, "0/4000000"), policy: Delayed, noWait: true,
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonUnknownAge, skew: time.Hour, fallback: true},
		{name: "an hour ahead, capped: refused as a failed attempt", tok: ahead(time.Hour, "0/4000000"), policy: Delayed, noWait: true, capped: true,
			action: ActionRefuse, outcome: OutcomeCapped, reason: ReasonCapped, delay: time.Second, skew: time.Hour},
		{name: "an hour ahead, sticky", tok: ahead(time.Hour, "0/4000000"), policy: Sticky,
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonReplicaBehind, skew: time.Hour, fallback: true},
		{name: "an hour ahead, caught up: the replica", tok: ahead(time.Hour, "0/2000000"), policy: Delayed,
			action: ActionRun, outcome: OutcomeReplica, reason: ReasonNone, skew: time.Hour},
		{name: "centuries ahead", tok: position.Of(time.UnixMilli(1<<53), ent("main", 1, "0/4000000")), policy: Delayed, noWait: true,
			action: ActionRun, outcome: OutcomePrimary, reason: ReasonUnknownAge, skew: math.MaxInt64, fallback: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			d := Decide(DecideInput{Policy: c.policy, Token: c.tok, Snapshot: snap(main), Now: t0, NoWait: c.noWait, Capped: c.capped})
			require.Equal(t, c.action, d.Action, "action")
			require.Equal(t, c.outcome, d.Outcome, "outcome")
			require.Equal(t, c.reason, d.Reason, "reason")
			require.Equal(t, c.delay, d.Delay, "delay")
			require.Equal(t, c.age, d.TokenAge, "age")
			require.Equal(t, c.skew, d.ClockSkew, "skew")
			require.Equal(t, c.fallback, d.Fallback, "fallback")
		})
	}
}

// TestDeferralBoundedUnderClockSkew retries a Delayed job whose position
// no replica ever reaches, as asynq and Kafka retry topics do: every
// attempt decides afresh, with no memory of the last, at the time the
// previous deferral named. Whatever the producer's skew, the job stops
// being deferred within MaxAge plus the tolerance of its capture time,
// and then reads the primary.
func TestDeferralBoundedUnderClockSkew(t *testing.T) {
	t.Parallel()
	for _, tol := range []time.Duration{0, DefaultClockSkewTolerance, time.Minute} {
		cfg := Config{ClockSkewTolerance: tol, MaxAge: 30 * time.Second}.WithDefaults()
		if tol == 0 {
			cfg.ClockSkewTolerance = 0 // no tolerance at all (WithDefaults would fill it in)
		}
		for _, skew := range []time.Duration{-time.Hour, -time.Second, 0, time.Second, tol, tol + time.Millisecond, time.Hour, 1000 * time.Hour} {
			tk := position.Of(t0.Add(skew), ent("main", 1, "0/4000000"))
			now, attempts := t0, 0
			var d Decision
			for {
				attempts++
				require.Less(t, attempts, 1000, "tolerance %v, skew %v: never stops deferring", tol, skew)
				// The tracker keeps observing the replica, which stays behind.
				s := snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000", func(r *replay.ReplicaState) { r.ObservedAt = now })))
				d = Decide(DecideInput{Policy: Delayed, Token: tk, Snapshot: s, Now: now, Config: &cfg, NoWait: true})
				if d.Action != ActionDefer {
					break
				}
				now = now.Add(d.Delay)
			}
			require.Equal(t, ActionRun, d.Action)
			require.Equal(t, OutcomePrimary, d.Outcome)
			require.Contains(t, []Reason{ReasonDeadline, ReasonUnknownAge}, d.Reason)
			deferred := now.Sub(t0)
			require.LessOrEqual(t, deferred, cfg.MaxAge+tol, "tolerance %v, skew %v", tol, skew)
			if skew > tol {
				require.Zero(t, deferred, "tolerance %v, skew %v: a capture time past the tolerance is never deferred", tol, skew)
			}
		}
	}
}
