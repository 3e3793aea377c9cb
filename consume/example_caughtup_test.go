package consume_test

import (
	"fmt"
	"time"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// CaughtUp says whether a replica has replayed a token, by the same rule
// Decide routes by: what a deferred job waits for. An adapter holding
// deferred jobs checks each against a snapshot and waits on the snapshot's
// Changed channel for the next one (Router.WaitCaughtUp does both for one
// token).
func ExampleCaughtUp() {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	epoch := position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}
	snap := &replay.Snapshot{Databases: []replay.DatabaseState{{
		Name:    "main",
		Primary: replay.PrimaryState{Epoch: epoch, HistoryKnown: true, ObservedAt: now},
		Replicas: []replay.ReplicaState{{
			Name:       "replica-a",
			Replayed:   position.Replayed{Epoch: epoch, LSN: position.MustParseLSN("0/3000000")},
			InRecovery: true, Healthy: true, ObservedAt: now,
		}},
	}}}
	cfg := consume.Config{}.WithDefaults()
	for _, at := range []string{"0/2000000", "0/4000000"} {
		tok := position.New("main", epoch, position.MustParseLSN(at), position.SourcePrimary, now)
		fmt.Println(at, consume.CaughtUp(tok, snap, now, &cfg))
	}
	// Unknown is never caught up: the same replica, silent for longer
	// than the staleness bound.
	tok := position.New("main", epoch, position.MustParseLSN("0/2000000"), position.SourcePrimary, now)
	fmt.Println("stale", consume.CaughtUp(tok, snap, now.Add(time.Minute), &cfg))
	// Output:
	// 0/2000000 true
	// 0/4000000 false
	// stale false
}
