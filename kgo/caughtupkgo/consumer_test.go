package caughtupkgo_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kgo/caughtupkgo"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// manualProducer returns a stamping producer whose records go to the
// partition they name.
func manualProducer(t testing.TB, topic string) *caughtupkgo.Producer {
	return caughtupkgo.NewProducer(newClient(t, kgo.DefaultProduceTopic(topic),
		kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.ProducerLinger(0)))
}

// pausedOf returns the partitions of topic whose fetches are paused.
func pausedOf(c *caughtupkgo.Consumer, topic string) []int32 {
	cl := c.Client()
	if cl == nil {
		return nil
	}
	return cl.PauseFetchPartitions(nil)[topic]
}

// TestPausedReplayWaitsPausedThenReplica: with replay paused on every
// replica, the records of partition 0 (written after the pause) wait at
// its head with the partition's fetches paused, while partition 1 (rows
// the replicas had) flows; once replay resumes, partition 0's records run
// on a replica, in order, none stale, none skipped.
func TestPausedReplayWaitsPausedThenReplica(t *testing.T) {
	e := setupDB(t, fastRouter)
	ctx := t.Context()
	topic := newTopics(t, 2, "")[0]
	p := manualProducer(t, topic)

	const n = 50 // per partition
	// Partition 1: rows the replicas have before the pause.
	var early []context.Context
	for i := range n {
		wctx, err := e.insert(ctx, int64(n+1+i), "b", i)
		require.NoError(t, err)
		early = append(early, wctx)
	}
	require.NoError(t, e.c.WaitReplicasCaughtUp(ctx))
	e.pauseAll(t)
	// Partition 0: rows the replicas do not have, all produced before the
	// consumer starts, so that most are fetched while the head waits.
	for i := range n {
		wctx, err := e.insert(ctx, int64(1+i), "a", i)
		require.NoError(t, err)
		require.NoError(t, p.ProduceSync(wctx, &kgo.Record{Partition: 0, Key: []byte("a"), Value: payload(int64(1+i), "a", i)}).FirstErr())
	}
	for i, wctx := range early {
		require.NoError(t, p.ProduceSync(wctx, &kgo.Record{Partition: 1, Key: []byte("b"), Value: payload(int64(n+1+i), "b", i)}).FirstErr())
	}

	l := newLedger()
	r := startConsumer(t, caughtupkgo.ConsumerConfig{
		Topic: topic, Router: e.router, Policy: consume.Delayed, MeterProvider: e.mp,
		QueueCapacity: 10, // partition 0's fetched records exceed it: they queue behind the head, paused
	}, l.handle)

	// Partition 1 flows while partition 0 waits.
	l.waitDistinct(t, n, 60*time.Second)
	require.Eventually(t, func() bool { return slices.Contains(pausedOf(r.c, topic), 0) }, 10*time.Second, 10*time.Millisecond,
		"partition 0 was never paused while its head waited")
	l.mu.Lock()
	for id, part := range l.partitions {
		require.Equal(t, int32(1), part, "record %d of partition 0 ran while no replica had it", id)
	}
	l.mu.Unlock()
	require.NotContains(t, pausedOf(r.c, topic), int32(1), "partition 1 was left paused")

	e.resumeAll(t)
	l.waitDistinct(t, 2*n, 60*time.Second)
	stale, lost, violations, _ := l.summary(2 * n)
	require.Zero(t, stale, "stale: %v", l.stale)
	require.Zero(t, lost)
	require.Zero(t, violations, "violations: %v", l.violations)
	l.mu.Lock()
	for o, k := range l.outcomes {
		require.Contains(t, []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited}, o,
			"%d records ran with outcome %s; every one should have run on a replica", k, o)
	}
	l.mu.Unlock()
	require.Eventually(t, func() bool { return len(pausedOf(r.c, topic)) == 0 }, 10*time.Second, 10*time.Millisecond,
		"partition 0 stayed paused after it drained")
	require.NoError(t, r.stop())
	res := e.sums(t, "caughtup.kafka.messages", "caughtup.kafka.result")
	require.Positive(t, res["waited"], "results %v", res)
	require.GreaterOrEqual(t, res["handled"], int64(2*n), "results %v", res)
}

// TestBadTokensReadPrimary: records without a token header, with one that
// does not decode, or with a good and a bad one, read the primary, are
// counted by reason, and never stop the partition.
func TestBadTokensReadPrimary(t *testing.T) {
	e := setupDB(t, fastRouter)
	ctx := t.Context()
	topic := newTopics(t, 1, "")[0]
	cl := newClient(t, kgo.DefaultProduceTopic(topic), kgo.ProducerLinger(0))
	good, err := e.insert(ctx, 1, "k", 0)
	require.NoError(t, err)
	for i, hs := range [][]kgo.RecordHeader{
		nil,
		{{Key: position.HeaderName, Value: []byte("v1;zz;main=p.1.1.not-an-lsn")}},
		{{Key: position.HeaderName, Value: []byte("\x00\xff garbage")}},
	} {
		id := int64(2 + i)
		_, err := e.insert(ctx, id, "k", i+1)
		require.NoError(t, err)
		require.NoError(t, cl.ProduceSync(ctx, &kgo.Record{Key: []byte("k"), Value: payload(id, "k", i+1), Headers: hs}).FirstErr())
	}
	// A good token merged with a bad one is unknown as a whole.
	rec := &kgo.Record{Key: []byte("k"), Value: payload(5, "k", 4),
		Headers: []kgo.RecordHeader{{Key: position.HeaderName, Value: []byte("not a token")}}}
	_, err = e.insert(ctx, 5, "k", 4)
	require.NoError(t, err)
	require.NoError(t, caughtupkgo.Stamp(good, rec))
	require.Len(t, rec.Headers, 1)
	require.Equal(t, "not a token", string(rec.Headers[0].Value), "Stamp must keep an unreadable header as it is")
	rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: position.HeaderName, Value: []byte(mustEncode(t, good))})
	require.NoError(t, cl.ProduceSync(ctx, rec).FirstErr())

	l := newLedger()
	r := startConsumer(t, caughtupkgo.ConsumerConfig{Topic: topic, Router: e.router, Policy: consume.Delayed, MeterProvider: e.mp}, l.handle)
	l.waitDistinct(t, 4, 60*time.Second)
	require.NoError(t, r.stop())
	l.mu.Lock()
	require.Empty(t, l.stale)
	require.Equal(t, map[int64]int{2: 1, 3: 1, 4: 1, 5: 1}, l.runs, "each bad record runs once, none is dropped")
	require.Equal(t, 4, l.outcomes[consume.OutcomePrimaryNoToken], "outcomes %v", l.outcomes)
	l.mu.Unlock()
	reasons := e.sums(t, "caughtup.consume.decisions", "caughtup.reason")
	require.Equal(t, int64(1), reasons[consume.ReasonNoToken.String()], "reasons %v", reasons)
	require.Equal(t, int64(3), reasons[consume.ReasonMalformedToken.String()], "reasons %v", reasons)
}

func mustEncode(t testing.TB, ctx context.Context) string {
	r := &kgo.Record{}
	require.NoError(t, caughtupkgo.Stamp(ctx, r))
	require.Len(t, r.Headers, 1)
	return string(r.Headers[0].Value)
}

// TestRebalanceLosesNothing: records produced while replay pauses at
// random are consumed by one member, then two (a rebalance), then the
// second alone (another): every record runs, none stale, per-key order
// kept across the handovers.
func TestRebalanceLosesNothing(t *testing.T) {
	e := setupDB(t, fastRouter)
	topic := newTopics(t, 4, "")[0]
	prod := caughtupkgo.NewProducer(newClient(t, kgo.DefaultProduceTopic(topic), kgo.ProducerLinger(0)))
	const n, keys = 1500, 16

	pctx, stopPauses := context.WithCancel(context.Background())
	var pauses sync.WaitGroup
	pauses.Go(func() { pauseRandomly(pctx, t, e.c.Replicas(), 800*time.Millisecond) })
	defer func() {
		stopPauses()
		pauses.Wait()
	}()

	l := newLedger()
	group := newGroup(t)
	cfg := caughtupkgo.ConsumerConfig{Topic: topic, GroupID: group, Router: e.router, Policy: consume.Delayed, MeterProvider: e.mp,
		ClientOpts: []kgo.Opt{kgo.SeedBrokers(brokers(t)...), kgo.SessionTimeout(2 * time.Second), kgo.RebalanceTimeout(5 * time.Second)}}
	a := startConsumer(t, cfg, l.handle)

	errs := make(chan error, keys)
	var prodWG sync.WaitGroup
	for k := range keys {
		prodWG.Go(func() {
			key := fmt.Sprintf("k%d", k)
			for i, seq := k+1, 0; i <= n; i, seq = i+keys, seq+1 {
				wctx, err := e.insert(context.Background(), int64(i), key, seq)
				if err == nil {
					err = prod.ProduceSync(wctx, &kgo.Record{Key: []byte(key), Value: payload(int64(i), key, seq)}).FirstErr()
				}
				if err != nil {
					errs <- fmt.Errorf("record %d: %w", i, err)
					return
				}
			}
		})
	}

	l.waitDistinct(t, n/4, 120*time.Second)
	b := startConsumer(t, cfg, l.handle)
	l.waitDistinct(t, n/2, 120*time.Second)
	require.NoError(t, a.stop())
	prodWG.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	l.waitDistinct(t, n, 180*time.Second)
	require.NoError(t, b.stop())
	stale, lost, violations, dups := l.summary(n)
	t.Logf("records=%d stale=%d lost=%d order_violations=%d duplicate_runs=%d outcomes=%v", n, stale, lost, violations, dups, l.outcomes)
	require.Zero(t, stale, "stale: %v", l.stale)
	require.Zero(t, lost)
	require.Zero(t, violations, "violations: %v", l.violations)
}

// pauseRandomly pauses replay on one or both replicas for random spells of
// up to maxPause until ctx ends, and leaves every replica resumed.
func pauseRandomly(ctx context.Context, t *testing.T, replicas []*pgtest.Node, maxPause time.Duration) {
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	bg := context.Background()
	for ctx.Err() == nil {
		paused := replicas
		if rng.IntN(3) != 0 {
			paused = []*pgtest.Node{replicas[rng.IntN(len(replicas))]}
		}
		for _, n := range paused {
			if err := n.PauseReplay(bg); err != nil {
				t.Errorf("pause %s: %v", n.Name(), err)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(int64(maxPause) + 1))):
		}
		for _, n := range paused {
			if err := n.ResumeReplay(bg); err != nil {
				t.Errorf("resume %s: %v", n.Name(), err)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(int64(300 * time.Millisecond)))):
		}
	}
}
