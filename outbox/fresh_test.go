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

// pauseReplay pauses replay on the replica. A pause takes effect when the
// replica next replays a record, so the request is made first and then a
// transaction on the primary provides that record; PauseReplay then waits
// for the pause state (on an idle cluster the next record could be 15 s
// away: the periodic running-xacts record).
func (e *env) pauseReplay(ctx context.Context) error {
	if _, err := e.replica.Exec(ctx, "SELECT pg_wal_replay_pause()"); err != nil {
		return err
	}
	if err := e.flushWAL(ctx); err != nil {
		return err
	}
	return e.replicaNode.PauseReplay(ctx)
}

// flushWAL commits a transaction that writes a commit record, which
// flushes all WAL before it, so that the WAL of still-open transactions
// reaches the replicas: walsenders send only flushed WAL, and the WAL
// writer leaves a partial page alone.
func (e *env) flushWAL(ctx context.Context) error {
	_, err := e.primary.Exec(ctx, "SELECT pg_current_xact_id()")
	return err
}

// toggleReplay injects lag: it pauses and resumes replay on the replica
// at random short intervals until stopped, and leaves it resumed. The
// pauses between steps are the fault's schedule, not waits.
func (e *env) toggleReplay(t *testing.T, ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			_ = e.pauseReplay(ctx)
			pause(ctx, time.Duration(rand.IntN(40))*time.Millisecond)
			_ = e.replicaNode.ResumeReplay(context.Background())
			pause(ctx, time.Duration(rand.IntN(15))*time.Millisecond)
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
			require.NoError(t, e.replicaNode.ResumeReplay(context.Background()))
		})
	}
	t.Cleanup(stop)
	return stop
}

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
				r, err := NewPollingRelay(PollingConfig{Primary: e.primary, Publisher: pub, BatchSize: 20, PollInterval: 2 * time.Millisecond, Logger: quiet})
				require.NoError(t, err)
				runInBackground(t, ctx, r.Run)
			case "logical":
				r := newLogical(t, e, LogicalConfig{Publisher: pub, FlushDelay: time.Millisecond})
				require.NoError(t, r.Setup(ctx))
				runInBackground(t, ctx, r.Run)
			}
			t.Cleanup(func() { _ = e.replicaNode.ResumeReplay(context.Background()) })

			// 1. Paused before the writes: every event must read the primary.
			require.NoError(t, e.pauseReplay(ctx))
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
			require.NoError(t, e.replicaNode.ResumeReplay(ctx))
			require.NoError(t, e.replicaNode.WaitReplay(ctx, maxTok.String()))
			for _, id := range ids {
				onReplica, stale, err := e.consumeCheck(ctx, got[id][0])
				require.NoError(t, err)
				require.True(t, onReplica)
				require.False(t, stale)
			}

			// 3. Random pauses under concurrent writers; the consumer checks
			// each event as soon as it is published.
			stopToggling := e.toggleReplay(t, ctx)
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

// pause is one step of a fault schedule, not a wait for a condition.
func pause(ctx context.Context, d time.Duration) { sleepCtx(ctx, d) }
