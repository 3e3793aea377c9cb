package kafka_test

import (
	"context"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	caughtupkafka "github.com/caughtup/caughtup/kafka"
)

// messageCount is the size of the big runs: 10,000 unless
// CAUGHTUP_KAFKA_MESSAGES says otherwise.
func messageCount(t testing.TB) int {
	if s := os.Getenv("CAUGHTUP_KAFKA_MESSAGES"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(t, err, "CAUGHTUP_KAFKA_MESSAGES")
		return n
	}
	return 10000
}

// TestInPlaceFreshAndOrderedUnderPausedReplay: 10,000 keyed messages, each
// produced right after its row's insert while replay pauses at random on
// one or both replicas. Every message runs, every read finds its row, and
// every key's messages run in order.
func TestInPlaceFreshAndOrderedUnderPausedReplay(t *testing.T) {
	e := setupDB(t, fastRouter)
	n := messageCount(t)
	topic := newTopics(t, 8, "")[0]
	l := newLedger(t)
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, Router: e.router, Policy: consume.Delayed, MeterProvider: e.mp,
	}, l.handle)

	pctx, stopPauses := context.WithCancel(t.Context())
	paused := make(chan struct{})
	go func() { defer close(paused); pauseRandomly(pctx, t, e.c.Replicas(), time.Second) }()
	start := time.Now()
	produceKeyed(t, e, caughtupkafka.NewWriter(newWriter(t, topic)), n, 128, 64)
	produced := time.Since(start)
	stopPauses()
	<-paused
	l.waitDistinct(t, n, 2*time.Minute)

	stale, lost, violations, dups := l.summary(n)
	t.Logf("messages=%d stale=%d lost=%d order_violations=%d duplicates=%d produced_in=%v total=%v",
		n, stale, lost, violations, dups, produced.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	t.Logf("router outcomes %v; consumer results %v", e.outcomes(t), e.results(t))
	require.Empty(t, l.stale, "stale reads")
	require.Zero(t, lost)
	require.Empty(t, l.violations, "per-key order")
}

// TestKillAndRestartLosesNothing: a consumer killed mid-run, without any
// final commit, and a new one in the same group: every message runs at
// least once, none is skipped, per-key order holds throughout.
func TestKillAndRestartLosesNothing(t *testing.T) {
	e := setupDB(t, fastRouter)
	const n = 3000
	topic := newTopics(t, 4, "")[0]
	group := newGroup(t)
	l := newLedger(t)
	cfg := caughtupkafka.ConsumerConfig{Topic: topic, GroupID: group, Router: e.router, Policy: consume.Delayed}
	first := startConsumer(t, cfg, l.handle)

	produced := make(chan struct{})
	go func() {
		defer close(produced)
		produceKeyed(t, e, caughtupkafka.NewWriter(newWriter(t, topic)), n, 32, 8)
	}()
	l.waitDistinct(t, n/3, time.Minute)
	require.NoError(t, first.crash())
	l.mu.Lock()
	atCrash := l.distinct
	l.mu.Unlock()

	startConsumer(t, cfg, l.handle)
	<-produced
	l.waitDistinct(t, n, 2*time.Minute)
	stale, lost, violations, dups := l.summary(n)
	t.Logf("crashed after %d messages; messages=%d stale=%d lost=%d order_violations=%d duplicates=%d",
		atCrash, n, stale, lost, violations, dups)
	require.Empty(t, l.stale)
	require.Zero(t, lost)
	require.Empty(t, l.violations)
}

// TestRebalanceKeepsOrder: a second member joins mid-run and the first
// leaves later; partitions move twice, and nothing is lost or reordered.
func TestRebalanceKeepsOrder(t *testing.T) {
	t.Parallel()
	e := setupDB(t, fastRouter)
	const n = 3000
	topic := newTopics(t, 6, "")[0]
	group := newGroup(t)
	l := newLedger(t)
	cfg := caughtupkafka.ConsumerConfig{Topic: topic, GroupID: group, Router: e.router, Policy: consume.Delayed}
	var byA, byB atomic.Int64
	counted := func(n *atomic.Int64) caughtupkafka.Handler {
		return func(ctx context.Context, msg kafkago.Message) error {
			err := l.handle(ctx, msg)
			if err == nil {
				n.Add(1)
			}
			return err
		}
	}
	a := startConsumer(t, cfg, counted(&byA))
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		produceKeyed(t, e, caughtupkafka.NewWriter(newWriter(t, topic)), n, 32, 8)
	}()
	l.waitDistinct(t, n/4, time.Minute)
	startConsumer(t, cfg, counted(&byB))
	l.waitDistinct(t, n/2, time.Minute)
	require.NoError(t, a.stop())
	<-produced
	l.waitDistinct(t, n, 2*time.Minute)
	stale, lost, violations, dups := l.summary(n)
	t.Logf("messages=%d stale=%d lost=%d order_violations=%d duplicates=%d; first member ran %d, second %d",
		n, stale, lost, violations, dups, byA.Load(), byB.Load())
	require.Empty(t, l.stale)
	require.Zero(t, lost)
	require.Empty(t, l.violations)
	require.Positive(t, byB.Load(), "the second member never got a partition")
}

// TestWaitingPartitionDoesNotStallOthers: the first message of one
// partition carries a token no replica will reach (far ahead of the
// primary) while the other partitions' messages carry fresh tokens. The
// other partitions drain while that partition waits, in order, until the
// token passes the router's MaxAge and the message reads the primary.
func TestWaitingPartitionDoesNotStallOthers(t *testing.T) {
	t.Parallel()
	const maxAge = 4 * time.Second
	e := setupDB(t, func(c *consume.Config) {
		fastRouter(c)
		c.MaxAge = maxAge
	})
	const parts = 4
	topic := newTopics(t, parts, "")[0]
	w := caughtupkafka.NewWriter(newWriter(t, topic))
	ctx := t.Context()

	blockedKey := keyFor(0, parts, "blocked")
	var warm, blockerRan, followersRan, othersRan atomic.Int64
	var blockerDecision atomic.Value
	var followerBeforeBlocker atomic.Bool
	startConsumer(t, caughtupkafka.ConsumerConfig{Topic: topic, Router: e.router, Policy: consume.Delayed, MeterProvider: e.mp},
		func(ctx context.Context, msg kafkago.Message) error {
			switch string(msg.Value) {
			case "warm-up":
				warm.Add(1)
			case "blocker":
				dec, _ := consume.DecisionFrom(ctx)
				blockerDecision.Store(dec)
				blockerRan.Add(1)
			case "follower":
				if blockerRan.Load() == 0 {
					followerBeforeBlocker.Store(true)
				}
				followersRan.Add(1)
			default:
				othersRan.Add(1)
			}
			return nil
		})

	// Wait until the group has joined (a real cluster delays the first
	// join): the clock below is about the wait, not the join.
	require.NoError(t, w.WriteMessages(ctx, kafkago.Message{Key: []byte(keyFor(1, parts, "other")), Value: []byte("warm-up")}))
	require.Eventually(t, func() bool { return warm.Load() == 1 }, 30*time.Second, 10*time.Millisecond)

	start := time.Now()
	require.NoError(t, w.WriteMessages(enqueue.WithToken(ctx, e.farAhead(t)),
		kafkago.Message{Key: []byte(blockedKey), Value: []byte("blocker")}))
	fresh, err := e.insert(ctx, 1, "fresh", 0)
	require.NoError(t, err)
	require.NoError(t, w.WriteMessages(fresh,
		kafkago.Message{Key: []byte(blockedKey), Value: []byte("follower")},
		kafkago.Message{Key: []byte(blockedKey), Value: []byte("follower")}))
	const others = 300
	var msgs []kafkago.Message
	for i := range others {
		msgs = append(msgs, kafkago.Message{Key: []byte(keyFor(1+i%(parts-1), parts, "other")), Value: []byte("other")})
	}
	require.NoError(t, w.WriteMessages(fresh, msgs...))

	require.Eventually(t, func() bool { return othersRan.Load() == others }, maxAge, 10*time.Millisecond,
		"the other partitions did not drain while one waited")
	drained := time.Since(start)
	require.Zero(t, blockerRan.Load(), "the blocker ran before its token could be served")
	require.Zero(t, followersRan.Load(), "a message behind the waiting one ran first")

	require.Eventually(t, func() bool { return followersRan.Load() == 2 }, maxAge+30*time.Second, 10*time.Millisecond)
	require.False(t, followerBeforeBlocker.Load(), "a follower ran before the blocker")
	dec := blockerDecision.Load().(consume.Decision)
	require.Equal(t, consume.OutcomePrimary, dec.Outcome)
	require.Equal(t, consume.ReasonDeadline, dec.Reason)
	t.Logf("others drained in %v while partition 0 waited; the blocker read the primary after %v (%s/%s)",
		drained.Round(time.Millisecond), time.Since(start).Round(time.Millisecond), dec.Outcome, dec.Reason)
	require.Positive(t, e.results(t)["waited"], "the blocker never waited in place")
}
