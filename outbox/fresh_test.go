package outbox

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
)

// TestRelaysGiveNoStaleReads is the acceptance test for both relays: a
// consumer that compares each event's token with the replica before
// reading there never reads a replica that lacks the event's row — with
// replay paused, after it resumes, and while it is paused and resumed at
// random under concurrent writes.
//
// Not parallel: it pauses replay on the shared cluster's first replica.
func TestRelaysGiveNoStaleReads(t *testing.T) {
	for _, kind := range []string{"polling", "logical"} {
		t.Run(kind, func(t *testing.T) {
			e := setup(t)
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			pub := newMemPublisher()
			switch kind {
			case "polling":
				r, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: pub, BatchSize: 20, PollInterval: 2 * time.Millisecond, Logger: quiet})
				require.NoError(t, err)
				runInBackground(t, ctx, r.Run)
			case "logical":
				r := newLogical(t, e, LogicalConfig{Publisher: pub, FlushDelay: time.Millisecond})
				require.NoError(t, r.Setup(ctx))
				runInBackground(t, ctx, r.Run)
			}
			t.Cleanup(func() { _ = e.ReplicaNode.ResumeReplay(context.Background()) })

			// 1. Paused before the writes: every event must read the primary.
			require.NoError(t, e.PauseReplay(ctx))
			ids := e.writeOrders(t, ctx, 1, 20)
			got := pub.waitFor(t, ctx, ids)
			var maxTok position.LSN
			for _, id := range ids {
				onReplica, stale, err := e.consumeCheck(ctx, got[id][0])
				require.NoError(t, err)
				require.False(t, stale)
				require.False(t, onReplica, "replica is paused before the write; the token must say behind")
				maxTok = max(maxTok, tokenLSN(t, got[id][0]))
			}

			// 2. Resumed and caught up to the tokens: every event reads the
			// replica and finds its row.
			require.NoError(t, e.ReplicaNode.ResumeReplay(ctx))
			require.NoError(t, e.ReplicaNode.WaitReplay(ctx, maxTok.String()))
			for _, id := range ids {
				onReplica, stale, err := e.consumeCheck(ctx, got[id][0])
				require.NoError(t, err)
				require.True(t, onReplica)
				require.False(t, stale)
			}

			// 3. Random pauses under concurrent writers; the consumer checks
			// each event as soon as it is published.
			stopToggling := e.ToggleReplay(t, ctx)
			var res readResult
			var checked atomic.Int64
			consumerDone := make(chan struct{})
			// This phase's orders have ids from 1000 up; the consumer
			// checks each of their events once, as soon as it is
			// published.
			phase3 := func(ev Event) bool {
				id, err := strconv.Atoi(string(ev.Key))
				return err == nil && id >= 1000
			}
			go func() {
				defer close(consumerDone)
				seen := map[string]bool{}
				for ctx.Err() == nil {
					events, changed := pub.next()
					for _, ev := range events {
						if !phase3(ev) || seen[ev.ID] {
							continue
						}
						seen[ev.ID] = true
						onReplica, stale, err := e.consumeCheck(ctx, ev)
						if err != nil {
							if ctx.Err() == nil {
								t.Errorf("consume %s: %v", ev.ID, err)
							}
							return
						}
						switch {
						case stale:
							res.stale++
							res.replica++
						case onReplica:
							res.replica++
						default:
							res.primary++
						}
						checked.Add(1)
					}
					if checked.Load() == 4*60 {
						return
					}
					select {
					case <-changed:
					case <-ctx.Done():
					}
				}
			}()
			var wg sync.WaitGroup
			for w := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range 60 {
						_, _, err := e.writeOrder(ctx, int64(1000*(w+1)+i))
						if !assert.NoError(t, err) {
							return
						}
						// Writers pace themselves unevenly against the
						// random pauses.
						time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
					}
				}()
			}
			wg.Wait()
			<-consumerDone
			stopToggling()
			require.EqualValues(t, 4*60, checked.Load())
			t.Logf("%s relay, random pauses: %d events read on the replica, %d sent to the primary, %d stale", kind, res.replica, res.primary, res.stale)
			require.Zero(t, res.stale, "stale reads")
		})
	}
}
