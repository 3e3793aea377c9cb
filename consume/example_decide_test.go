package consume_test

import (
	"fmt"
	"time"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// Decide is a pure function: give it a tracker snapshot, a token and the
// time, and it says where the job runs.
func ExampleDecide() {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	epoch := position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}
	replica := func(name, replayed string) replay.ReplicaState {
		return replay.ReplicaState{
			Name:       name,
			Replayed:   position.Replayed{Epoch: epoch, LSN: position.MustParseLSN(replayed)},
			InRecovery: true, Healthy: true, ObservedAt: now,
		}
	}
	snap := &replay.Snapshot{Databases: []replay.DatabaseState{{
		Name:     "main",
		Primary:  replay.PrimaryState{Epoch: epoch, HistoryKnown: true, ObservedAt: now},
		Replicas: []replay.ReplicaState{replica("replica-a", "0/3000000"), replica("replica-b", "0/1000000")},
	}}}
	cfg := consume.Config{}.WithDefaults()
	decide := func(policy consume.Policy, at string, noWait bool) consume.Decision {
		tok := position.New("main", epoch, position.MustParseLSN(at), position.SourcePrimary, now.Add(-time.Second))
		return consume.Decide(consume.DecideInput{
			Policy: policy, Token: tok, Snapshot: snap, Now: now, Config: &cfg, NoWait: noWait,
		})
	}

	d := decide(consume.Sticky, "0/2000000", false)
	fmt.Println(d.Outcome, d.Databases[0].Replica)
	d = decide(consume.Sticky, "0/4000000", false)
	fmt.Println(d.Outcome, d.Reason)
	d = decide(consume.Delayed, "0/4000000", false)
	fmt.Println(d.Action)
	d = decide(consume.Delayed, "0/4000000", true)
	fmt.Println(d.Outcome, d.Reason, d.Delay)
	// Output:
	// replica replica-a
	// primary replica_behind
	// wait
	// deferred replica_behind 2s
}
