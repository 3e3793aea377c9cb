package caughtupkafka_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
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
	e := setupDB(t, kafkasuite.FastRouter)
	n := messageCount(t)
	topic := kafkasuite.NewTopics(t, 8, "")[0]
	l := kafkasuite.NewLedger()
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
	}, ledgerHandler(l))

	pctx, stopPauses := context.WithCancel(t.Context())
	paused := make(chan struct{})
	go func() { defer close(paused); kafkasuite.PauseRandomly(pctx, t, e.Cluster.Replicas(), time.Second) }()
	start := time.Now()
	produceKeyed(t, e, caughtupkafka.NewWriter(newWriter(t, topic)), n, 128, 64)
	produced := time.Since(start)
	stopPauses()
	<-paused
	l.WaitDistinct(t, n, 2*time.Minute)

	stale, lost, violations, dups := l.Summary(n)
	t.Logf("messages=%d stale=%d lost=%d order_violations=%d duplicates=%d produced_in=%v total=%v",
		n, stale, lost, violations, dups, produced.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	t.Logf("router outcomes %v; consumer results %v", e.Outcomes(t), e.Results(t))
	require.Empty(t, l.Stale(), "stale reads")
	require.Zero(t, lost)
	require.Empty(t, l.Violations(), "per-key order")
}

// TestInPlaceBatchesOfOneTokenUnderPausedReplay: batches of 50 rows, each
// inserted in one transaction and published as 50 messages stamped with
// the one token of its commit (as an outbox relay's batch is), while
// replay pauses at random on one or both replicas. The batches take turns
// between two keys, so each key's batches follow one another on one
// partition, one batch's token right after the last's, where a Tally's
// job with the last job's token repeats its decision: every read still
// finds its row (a batch that repeated the batch before it would not,
// during a pause), nothing is lost, order holds, and most messages did run
// on a repeated decision (fewer handler contexts than messages).
func TestInPlaceBatchesOfOneTokenUnderPausedReplay(t *testing.T) {
	e := setupDB(t, kafkasuite.FastRouter)
	const batch = 50
	batches := max(1, messageCount(t)/batch)
	n := batches * batch
	topic := kafkasuite.NewTopics(t, 4, "")[0]
	l := kafkasuite.NewLedger()
	var mu sync.Mutex
	contexts := map[context.Context]int{}
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
	}, func(ctx context.Context, msg kafka.Message) error {
		mu.Lock()
		contexts[ctx]++
		mu.Unlock()
		return ledgerHandler(l)(ctx, msg)
	})

	pctx, stopPauses := context.WithCancel(t.Context())
	paused := make(chan struct{})
	go func() {
		defer close(paused)
		kafkasuite.PauseRandomly(pctx, t, e.Cluster.Replicas(), 300*time.Millisecond)
	}()
	w := caughtupkafka.NewWriter(newWriter(t, topic))
	ctx := t.Context()
	for b := range batches {
		key, first := fmt.Sprintf("k%d", b%2), b/2*batch
		tctx, err := enqueue.InTx(ctx, e.Primary, func(tx pgx.Tx) error {
			for i := range batch {
				if _, err := tx.Exec(ctx, `INSERT INTO items (id, key, seq) VALUES ($1, $2, $3)`, int64(b*batch+i+1), key, first+i); err != nil {
					return err
				}
			}
			return nil
		})
		require.NoError(t, err)
		msgs := make([]kafka.Message, batch)
		for i := range msgs {
			msgs[i] = kafka.Message{Key: []byte(key), Value: kafkasuite.Payload(int64(b*batch+i+1), key, first+i)}
		}
		require.NoError(t, w.WriteMessages(tctx, msgs...))
	}
	stopPauses()
	<-paused
	l.WaitDistinct(t, n, 2*time.Minute)

	stale, lost, violations, dups := l.Summary(n)
	mu.Lock()
	distinct := len(contexts)
	mu.Unlock()
	t.Logf("messages=%d stale=%d lost=%d order_violations=%d duplicates=%d handler_contexts=%d", n, stale, lost, violations, dups, distinct)
	t.Logf("router outcomes %v; consumer results %v", e.Outcomes(t), e.Results(t))
	require.Empty(t, l.Stale(), "stale reads")
	require.Zero(t, lost)
	require.Empty(t, l.Violations(), "per-key order")
	require.Less(t, distinct, n/2, "messages with the last one's token mostly repeat its decision")
}

// TestKillAndRestartLosesNothing: a consumer killed mid-run the way a
// process dies (connections reset, no new ones, so no final commit and no
// LeaveGroup), and a new one in the same group once the coordinator has
// expired the first: every message runs at least once, none is skipped,
// per-key order holds throughout.
func TestKillAndRestartLosesNothing(t *testing.T) {
	e := setupDB(t, kafkasuite.FastRouter)
	const n = 3000
	topic := kafkasuite.NewTopics(t, 4, "")[0]
	group := kafkasuite.NewGroup(t)
	l := kafkasuite.NewLedger()
	cfg := killable(caughtupkafka.ConsumerConfig{Topic: topic, GroupID: group, Router: e.Router, Policy: consume.Delayed})
	first := startConsumer(t, cfg, ledgerHandler(l))

	produced := make(chan struct{})
	go func() {
		defer close(produced)
		produceKeyed(t, e, caughtupkafka.NewWriter(newWriter(t, topic)), n, 32, 8)
	}()
	l.WaitDistinct(t, n/3, time.Minute)
	require.NoError(t, first.kill())
	atKill := l.Count()

	startConsumer(t, cfg, ledgerHandler(l))
	<-produced
	l.WaitDistinct(t, n, 2*time.Minute)
	stale, lost, violations, dups := l.Summary(n)
	t.Logf("killed after %d messages; messages=%d stale=%d lost=%d order_violations=%d duplicates=%d",
		atKill, n, stale, lost, violations, dups)
	require.Empty(t, l.Stale())
	require.Zero(t, lost)
	require.Empty(t, l.Violations())
}

// TestRebalanceKeepsOrder: a second member joins mid-run and the first
// leaves later; partitions move twice, and nothing is lost or reordered.
func TestRebalanceKeepsOrder(t *testing.T) {
	t.Parallel()
	e := setupDB(t, kafkasuite.FastRouter)
	const n = 3000
	topic := kafkasuite.NewTopics(t, 6, "")[0]
	group := kafkasuite.NewGroup(t)
	l := kafkasuite.NewLedger()
	cfg := caughtupkafka.ConsumerConfig{Topic: topic, GroupID: group, Router: e.Router, Policy: consume.Delayed}
	var byA, byB atomic.Int64
	counted := func(n *atomic.Int64) caughtupkafka.Handler {
		return func(ctx context.Context, msg kafka.Message) error {
			err := ledgerHandler(l)(ctx, msg)
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
	l.WaitDistinct(t, n/4, time.Minute)
	startConsumer(t, cfg, counted(&byB))
	l.WaitDistinct(t, n/2, time.Minute)
	require.NoError(t, a.Stop())
	<-produced
	l.WaitDistinct(t, n, 2*time.Minute)
	stale, lost, violations, dups := l.Summary(n)
	t.Logf("messages=%d stale=%d lost=%d order_violations=%d duplicates=%d; first member ran %d, second %d",
		n, stale, lost, violations, dups, byA.Load(), byB.Load())
	require.Empty(t, l.Stale())
	require.Zero(t, lost)
	require.Empty(t, l.Violations())
	require.Positive(t, byB.Load(), "the second member never got a partition")
}

// partitionProbe is the handler of the waiting-partition tests: it
// records what ran, in which order, and the blocker's decision.
type partitionProbe struct {
	others                int64
	warm                  chan struct{}
	blocker               chan consume.Decision
	othersDone, followers chan struct{}

	mu                    sync.Mutex
	othersRan, followRan  int64
	blockerRan            bool
	followerBeforeBlocker bool
}

func newPartitionProbe(others int64) *partitionProbe {
	return &partitionProbe{others: others, warm: make(chan struct{}, 1), blocker: make(chan consume.Decision, 1),
		othersDone: make(chan struct{}), followers: make(chan struct{})}
}

func (p *partitionProbe) handle(ctx context.Context, msg kafka.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch string(msg.Value) {
	case "warm-up":
		select {
		case p.warm <- struct{}{}:
		default:
		}
	case "blocker":
		dec, _ := consume.DecisionFrom(ctx)
		if !p.blockerRan {
			p.blockerRan = true
			p.blocker <- dec
		}
	case "follower":
		if !p.blockerRan {
			p.followerBeforeBlocker = true
		}
		if p.followRan++; p.followRan == 2 {
			close(p.followers)
		}
	default:
		if p.othersRan++; p.othersRan == p.others {
			close(p.othersDone)
		}
	}
	return nil
}

// state returns what ran so far.
func (p *partitionProbe) state() (blockerRan bool, followers, others int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.blockerRan, p.followRan, p.othersRan
}

// wait waits for ch to be closed or to deliver, failing after a minute.
func wait[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(time.Minute):
		t.Fatalf("%s did not happen within a minute", what)
		panic("unreachable")
	}
}

// TestWaitingPartitionDoesNotStallOthers: with replay paused on every
// replica, the first message of one partition carries the token of a
// write no replica has, and two messages of its key follow it; the other
// partitions' messages carry a token the replicas have. The other
// partitions drain while that partition waits in place, in order; once
// replay resumes the blocker runs on a replica, then its followers.
func TestWaitingPartitionDoesNotStallOthers(t *testing.T) {
	e := setupDB(t, kafkasuite.FastRouter)
	const parts, others = 4, 300
	topic := kafkasuite.NewTopics(t, parts, "")[0]
	w := caughtupkafka.NewWriter(newWriter(t, topic))
	ctx := t.Context()
	probe := newPartitionProbe(others)
	startConsumer(t, caughtupkafka.ConsumerConfig{Topic: topic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP}, probe.handle)

	// The group joins first (a real cluster delays the first join).
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte(keyFor(1, parts, "other")), Value: []byte("warm-up")}))
	wait(t, probe.warm, "the warm-up message")

	fresh, err := e.Insert(ctx, 1, "fresh", 0)
	require.NoError(t, err)
	require.NoError(t, e.Cluster.WaitReplicasCaughtUp(ctx))
	e.PauseAll(t)
	behind, err := e.Insert(ctx, 2, "behind", 0)
	require.NoError(t, err)

	blockedKey := keyFor(0, parts, "blocked")
	require.NoError(t, w.WriteMessages(behind, kafka.Message{Key: []byte(blockedKey), Value: []byte("blocker")}))
	require.NoError(t, w.WriteMessages(fresh,
		kafka.Message{Key: []byte(blockedKey), Value: []byte("follower")},
		kafka.Message{Key: []byte(blockedKey), Value: []byte("follower")}))
	var msgs []kafka.Message
	for i := range others {
		msgs = append(msgs, kafka.Message{Key: []byte(keyFor(1+i%(parts-1), parts, "other")), Value: []byte("other")})
	}
	require.NoError(t, w.WriteMessages(fresh, msgs...))

	wait(t, probe.othersDone, "draining the other partitions while one waits")
	blockerRan, followers, _ := probe.state()
	require.False(t, blockerRan, "the blocker ran while no replica had its write")
	require.Zero(t, followers, "a message behind the waiting one ran first")
	require.Eventually(t, func() bool { return e.Results(t)["waited"] > 0 }, time.Minute, 10*time.Millisecond,
		"the blocker never waited in place")

	e.ResumeAll(t)
	dec := wait(t, probe.blocker, "the blocker's run after replay resumed")
	wait(t, probe.followers, "the followers' runs")
	require.Contains(t, []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited}, dec.Outcome)
	probe.mu.Lock()
	defer probe.mu.Unlock()
	require.False(t, probe.followerBeforeBlocker, "a follower ran before the blocker")
	t.Logf("others drained while partition 0 waited; then the blocker ran (%s), then its followers", dec.Outcome)
}

// TestInPlaceWaitEndsOnThePrimaryAtMaxAge: a message whose token no
// replica will reach (far ahead of the primary) waits in place, holding
// back the messages of its partition, until the token is older than the
// router's MaxAge; then it reads the primary (ReasonDeadline), and the
// messages behind it follow in order.
func TestInPlaceWaitEndsOnThePrimaryAtMaxAge(t *testing.T) {
	t.Parallel()
	e := setupDB(t, func(c *consume.Config) {
		kafkasuite.FastRouter(c)
		c.MaxAge = 3 * time.Second
	})
	topic := kafkasuite.NewTopics(t, 1, "")[0]
	w := caughtupkafka.NewWriter(newWriter(t, topic))
	ctx := t.Context()
	probe := newPartitionProbe(0)
	startConsumer(t, caughtupkafka.ConsumerConfig{Topic: topic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP}, probe.handle)
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("warm-up")}))
	wait(t, probe.warm, "the warm-up message")

	require.NoError(t, w.WriteMessages(enqueue.WithToken(ctx, e.FarAhead(t)), kafka.Message{Key: []byte("k"), Value: []byte("blocker")}))
	fresh, err := e.Insert(ctx, 1, "fresh", 0)
	require.NoError(t, err)
	require.NoError(t, w.WriteMessages(fresh,
		kafka.Message{Key: []byte("k"), Value: []byte("follower")},
		kafka.Message{Key: []byte("k"), Value: []byte("follower")}))

	dec := wait(t, probe.blocker, "the blocker's run")
	wait(t, probe.followers, "the followers' runs")
	require.Equal(t, consume.OutcomePrimary, dec.Outcome)
	require.Equal(t, consume.ReasonDeadline, dec.Reason)
	require.Eventually(t, func() bool { return e.Results(t)["waited"] > 0 }, 30*time.Second, 10*time.Millisecond,
		"the blocker never waited in place")
	probe.mu.Lock()
	defer probe.mu.Unlock()
	require.False(t, probe.followerBeforeBlocker, "a follower ran before the blocker")
}
