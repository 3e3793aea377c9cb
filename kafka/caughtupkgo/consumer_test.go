package caughtupkgo_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
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
	e := setupDB(t, kafkasuite.FastRouter)
	ctx := t.Context()
	topic := kafkasuite.NewTopics(t, 2, "")[0]
	p := manualProducer(t, topic)

	const n = 50 // per partition
	// Partition 1: rows the replicas have before the pause.
	var early []context.Context
	for i := range n {
		wctx, err := e.Insert(ctx, int64(n+1+i), "b", i)
		require.NoError(t, err)
		early = append(early, wctx)
	}
	require.NoError(t, e.Cluster.WaitReplicasCaughtUp(ctx))
	e.PauseAll(t)
	// Partition 0: rows the replicas do not have, all produced before the
	// consumer starts, so that most are fetched while the head waits.
	for i := range n {
		wctx, err := e.Insert(ctx, int64(1+i), "a", i)
		require.NoError(t, err)
		require.NoError(t, p.ProduceSync(wctx, &kgo.Record{Partition: 0, Key: []byte("a"), Value: kafkasuite.Payload(int64(1+i), "a", i)}).FirstErr())
	}
	for i, wctx := range early {
		require.NoError(t, p.ProduceSync(wctx, &kgo.Record{Partition: 1, Key: []byte("b"), Value: kafkasuite.Payload(int64(n+1+i), "b", i)}).FirstErr())
	}

	l := kafkasuite.NewLedger()
	r := startConsumer(t, caughtupkgo.ConsumerConfig{
		Topic: topic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
		QueueCapacity: 10, // partition 0's fetched records exceed it: they queue behind the head, paused
	}, ledgerHandler(l))

	// Partition 1 flows while partition 0 waits.
	l.WaitDistinct(t, n, 60*time.Second)
	require.Eventually(t, func() bool { return slices.Contains(pausedOf(r.c, topic), 0) }, 10*time.Second, 10*time.Millisecond,
		"partition 0 was never paused while its head waited")
	for id, part := range l.Partitions() {
		require.Equal(t, int32(1), part, "record %d of partition 0 ran while no replica had it", id)
	}
	require.NotContains(t, pausedOf(r.c, topic), int32(1), "partition 1 was left paused")

	e.ResumeAll(t)
	l.WaitDistinct(t, 2*n, 60*time.Second)
	stale, lost, violations, _ := l.Summary(2 * n)
	require.Zero(t, stale, "stale: %v", l.Stale())
	require.Zero(t, lost)
	require.Zero(t, violations, "violations: %v", l.Violations())
	for o, k := range l.Outcomes() {
		require.Contains(t, []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited}, o,
			"%d records ran with outcome %s; every one should have run on a replica", k, o)
	}
	require.Eventually(t, func() bool { return len(pausedOf(r.c, topic)) == 0 }, 10*time.Second, 10*time.Millisecond,
		"partition 0 stayed paused after it drained")
	require.NoError(t, r.Stop())
	res := e.Sums(t, "caughtup.kafka.messages", "caughtup.kafka.result")
	require.Positive(t, res["waited"], "results %v", res)
	require.GreaterOrEqual(t, res["handled"], int64(2*n), "results %v", res)
}

// TestBadTokensReadPrimary: records without a token header, with one that
// does not decode, or with a good and a bad one, read the primary, are
// counted by reason, and never stop the partition.
func TestBadTokensReadPrimary(t *testing.T) {
	e := setupDB(t, kafkasuite.FastRouter)
	ctx := t.Context()
	topic := kafkasuite.NewTopics(t, 1, "")[0]
	cl := newClient(t, kgo.DefaultProduceTopic(topic), kgo.ProducerLinger(0))
	good, err := e.Insert(ctx, 1, "k", 0)
	require.NoError(t, err)
	for i, hs := range [][]kgo.RecordHeader{
		nil,
		{{Key: position.HeaderName, Value: []byte("v1;zz;main=p.1.1.not-an-lsn")}},
		{{Key: position.HeaderName, Value: []byte("\x00\xff garbage")}},
	} {
		id := int64(2 + i)
		_, err := e.Insert(ctx, id, "k", i+1)
		require.NoError(t, err)
		require.NoError(t, cl.ProduceSync(ctx, &kgo.Record{Key: []byte("k"), Value: kafkasuite.Payload(id, "k", i+1), Headers: hs}).FirstErr())
	}
	// A good token merged with a bad one is unknown as a whole.
	rec := &kgo.Record{Key: []byte("k"), Value: kafkasuite.Payload(5, "k", 4),
		Headers: []kgo.RecordHeader{{Key: position.HeaderName, Value: []byte("not a token")}}}
	_, err = e.Insert(ctx, 5, "k", 4)
	require.NoError(t, err)
	require.NoError(t, caughtupkgo.Stamp(good, rec))
	require.Len(t, rec.Headers, 1)
	require.Equal(t, "not a token", string(rec.Headers[0].Value), "Stamp must keep an unreadable header as it is")
	rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: position.HeaderName, Value: []byte(mustEncode(t, good))})
	require.NoError(t, cl.ProduceSync(ctx, rec).FirstErr())

	l := kafkasuite.NewLedger()
	r := startConsumer(t, caughtupkgo.ConsumerConfig{Topic: topic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP}, ledgerHandler(l))
	l.WaitDistinct(t, 4, 60*time.Second)
	require.NoError(t, r.Stop())
	require.Empty(t, l.Stale())
	require.Equal(t, map[int64]int{2: 1, 3: 1, 4: 1, 5: 1}, l.Runs(), "each bad record runs once, none is dropped")
	require.Equal(t, 4, l.Outcomes()[consume.OutcomePrimaryNoToken], "outcomes %v", l.Outcomes())
	reasons := e.Sums(t, "caughtup.consume.decisions", "caughtup.reason")
	require.Equal(t, int64(1), reasons[consume.ReasonNoToken.String()], "reasons %v", reasons)
	require.Equal(t, int64(3), reasons[consume.ReasonMalformedToken.String()], "reasons %v", reasons)
}

func mustEncode(t testing.TB, ctx context.Context) string {
	r := &kgo.Record{}
	require.NoError(t, caughtupkgo.Stamp(ctx, r))
	require.Len(t, r.Headers, 1)
	return string(r.Headers[0].Value)
}

// member counts the records one consumer of a group ran.
type member struct {
	runs atomic.Int64
}

func (m *member) handler(l *kafkasuite.Ledger) caughtupkgo.Handler {
	return func(ctx context.Context, r *kgo.Record) error {
		err := ledgerHandler(l)(ctx, r)
		if err == nil {
			m.runs.Add(1)
		}
		return err
	}
}

// keyedProducer writes records from..to (ids) of keys keys, each after its
// row's commit, per-key sequence numbers in order (one goroutine per key).
type keyedProducer struct {
	e    *env
	p    *caughtupkgo.Producer
	keys int
}

func (kp *keyedProducer) produce(t testing.TB, from, to int) {
	t.Helper()
	errs := make(chan error, kp.keys)
	var wg sync.WaitGroup
	for k := range kp.keys {
		wg.Go(func() {
			key := fmt.Sprintf("k%d", k)
			for i := from; i <= to; i++ {
				if (i-1)%kp.keys != k {
					continue
				}
				seq := (i - 1) / kp.keys
				wctx, err := kp.e.Insert(context.Background(), int64(i), key, seq)
				if err == nil {
					err = kp.p.ProduceSync(wctx, &kgo.Record{Key: []byte(key), Value: kafkasuite.Payload(int64(i), key, seq)}).FirstErr()
				}
				if err != nil {
					errs <- fmt.Errorf("record %d: %w", i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// rebalanceSetup is a topic of 4 partitions, a group config for it, a
// producer and random replay pauses until the test ends.
func rebalanceSetup(t *testing.T) (*env, caughtupkgo.ConsumerConfig, *keyedProducer, *kafkasuite.Ledger) {
	e := setupDB(t, kafkasuite.FastRouter)
	topic := kafkasuite.NewTopics(t, 4, "")[0]
	kp := &keyedProducer{e: e, p: caughtupkgo.NewProducer(newClient(t, kgo.DefaultProduceTopic(topic), kgo.ProducerLinger(0))), keys: 16}
	pctx, stopPauses := context.WithCancel(context.Background())
	var pauses sync.WaitGroup
	pauses.Go(func() { kafkasuite.PauseRandomly(pctx, t, e.Cluster.Replicas(), 800*time.Millisecond) })
	t.Cleanup(func() {
		stopPauses()
		pauses.Wait()
	})
	cfg := caughtupkgo.ConsumerConfig{Topic: topic, GroupID: kafkasuite.NewGroup(t), Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP}
	return e, cfg, kp, kafkasuite.NewLedger()
}

// withSession gives the group a short session and rebalance timeout, so
// that a vanished member's partitions move on within seconds (the test
// binary's broker allows 1s, see TestMain).
func withSession(cfg caughtupkgo.ConsumerConfig, t testing.TB, extra ...kgo.Opt) caughtupkgo.ConsumerConfig {
	cfg.ClientOpts = append([]kgo.Opt{kgo.SeedBrokers(kafkasuite.Brokers(t)...),
		kgo.SessionTimeout(2 * time.Second), kgo.RebalanceTimeout(5 * time.Second)}, extra...)
	return cfg
}

func checkLedger(t *testing.T, l *kafkasuite.Ledger, n int) {
	t.Helper()
	stale, lost, violations, dups := l.Summary(n)
	t.Logf("records=%d stale=%d lost=%d order_violations=%d duplicate_runs=%d outcomes=%v", n, stale, lost, violations, dups, l.Outcomes())
	require.Zero(t, stale, "stale: %v", l.Stale())
	require.Zero(t, lost)
	require.Zero(t, violations, "violations: %v", l.Violations())
}

// TestRebalanceLosesNothing: records produced while replay pauses at
// random are consumed by one member, then two (a rebalance: some of the
// first's partitions are revoked, mid-queue or mid-wait), then the second
// alone after the first leaves (another): every record runs, none stale,
// per-key order kept across the handovers.
func TestRebalanceLosesNothing(t *testing.T) {
	_, cfg, kp, l := rebalanceSetup(t)
	cfg = withSession(cfg, t)
	var ma, mb member
	a := startConsumer(t, cfg, ma.handler(l))
	n := 600
	kp.produce(t, 1, n)
	l.WaitDistinct(t, n, 120*time.Second)

	b := startConsumer(t, cfg, mb.handler(l))
	n = produceUntil(t, kp, n, func() bool { return mb.runs.Load() > 0 })
	require.NoError(t, a.Stop())
	kp.produce(t, n+1, n+600)
	n += 600
	l.WaitDistinct(t, n, 120*time.Second)
	require.NoError(t, b.Stop())
	require.Positive(t, ma.runs.Load())
	checkLedger(t, l, n)
}

// produceUntil produces batches of records after id last until done
// reports true (a minute at most) and returns the last id produced.
func produceUntil(t *testing.T, kp *keyedProducer, last int, done func() bool) int {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !done() {
		require.True(t, time.Now().Before(deadline), "the second member ran nothing within a minute")
		kp.produce(t, last+1, last+200)
		last += 200
		time.Sleep(50 * time.Millisecond)
	}
	return last
}

// TestKilledMemberLosesNothing: a member that vanishes (every connection
// cut, none possible) commits nothing more; once the coordinator expires
// it the other member gets its partitions from the last commit and runs
// what the dead one had not committed: nothing lost, none stale.
func TestKilledMemberLosesNothing(t *testing.T) {
	_, cfg, kp, l := rebalanceSetup(t)
	dialer := fault.NewDialer(nil)
	var ma, mb member
	a := startConsumer(t, withSession(cfg, t, kgo.Dialer(dialer.DialContext)), ma.handler(l))
	n := 600
	kp.produce(t, 1, n)
	l.WaitDistinct(t, n/2, 120*time.Second)

	b := startConsumer(t, withSession(cfg, t), mb.handler(l))
	n = produceUntil(t, kp, n, func() bool { return mb.runs.Load() > 0 })
	dialer.Refuse(true)
	dialer.Cut()
	kp.produce(t, n+1, n+600)
	n += 600
	l.WaitDistinct(t, n, 180*time.Second)
	require.NoError(t, b.Stop())
	require.NoError(t, a.Stop())
	checkLedger(t, l, n)
}

// TestHandlerErrorsDeadLetter: a record whose handler keeps failing runs
// MaxAttempts times (Attempt counting 0, 1, 2), then goes to the
// dead-letter topic with its attempts, its error and its token; the
// records behind it run. In both modes.
func TestHandlerErrorsDeadLetter(t *testing.T) {
	for _, mode := range []caughtupkgo.Mode{caughtupkgo.InPlace, caughtupkgo.RetryTopic} {
		t.Run(mode.String(), func(t *testing.T) {
			e := setupDB(t, kafkasuite.FastRouter)
			names := kafkasuite.NewTopics(t, 1, "", ".retry", ".dlt")
			p := caughtupkgo.NewProducer(newClient(t, kgo.DefaultProduceTopic(names[0]), kgo.ProducerLinger(0)))
			for i := 1; i <= 3; i++ {
				wctx, err := e.Insert(t.Context(), int64(i), "k", i-1)
				require.NoError(t, err)
				require.NoError(t, p.ProduceSync(wctx, &kgo.Record{Key: []byte("k"), Value: kafkasuite.Payload(int64(i), "k", i-1)}).FirstErr())
			}
			l := kafkasuite.NewLedger()
			var mu sync.Mutex
			var attempts []int
			r := startConsumer(t, caughtupkgo.ConsumerConfig{
				Topic: names[0], Mode: mode, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP, MaxAttempts: 3,
			}, func(ctx context.Context, rec *kgo.Record) error {
				id, _, _, err := kafkasuite.ParsePayload(rec.Value)
				if err != nil {
					return err
				}
				if id == 1 {
					mu.Lock()
					attempts = append(attempts, caughtupkgo.Attempt(ctx))
					mu.Unlock()
					return fmt.Errorf("record %d always fails", id)
				}
				return ledgerHandler(l)(ctx, rec)
			})
			l.WaitDistinct(t, 2, 60*time.Second)
			cl := newClient(t, kgo.ConsumeTopics(names[2]), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
			fctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			var dead []*kgo.Record
			for len(dead) == 0 && fctx.Err() == nil {
				dead = append(dead, cl.PollFetches(fctx).Records()...)
			}
			require.NoError(t, r.Stop())
			require.Len(t, dead, 1)
			hs := map[string]string{}
			for _, h := range dead[0].Headers {
				hs[h.Key] = string(h.Value)
			}
			require.Equal(t, "3", hs[kafka.HeaderAttempts])
			require.Contains(t, hs[kafka.HeaderError], "always fails")
			require.Equal(t, names[0], hs[kafka.HeaderOriginTopic])
			require.NotEmpty(t, hs[position.HeaderName], "the token travels with the dead letter")
			mu.Lock()
			require.Equal(t, []int{0, 1, 2}, attempts)
			mu.Unlock()
		})
	}
}

// TestSlowPartitionDoesNotHoldOthers: a partition whose handler is slow
// fills its queue and is paused, and the other flows to its end long
// before the slow one is done. Nothing is skipped, and the slow
// partition's records are not fetched over and over: a pause with records
// of it still buffered would have franz-go drop them and fetch them again
// on resume.
func TestSlowPartitionDoesNotHoldOthers(t *testing.T) {
	e := setupDB(t, nil)
	topic := kafkasuite.NewTopics(t, 2, "")[0]
	p := manualProducer(t, topic)
	const n = 200
	for part := range int32(2) {
		for i := range n {
			require.NoError(t, p.ProduceSync(t.Context(), &kgo.Record{Partition: part, Value: []byte(strconv.Itoa(i))}).FirstErr())
		}
	}
	var mu sync.Mutex
	next := [2]int{}
	var skipped []string
	fastDone := make(chan [2]int, 1)
	var read fetchCounter
	r := startConsumer(t, caughtupkgo.ConsumerConfig{
		Topic: topic, Router: e.Router, Policy: consume.Always, MeterProvider: e.MP,
		QueueCapacity: 10,
		ClientOpts:    []kgo.Opt{kgo.SeedBrokers(kafkasuite.Brokers(t)...), kgo.WithHooks(&read)},
	}, func(ctx context.Context, rec *kgo.Record) error {
		if rec.Partition == 0 {
			time.Sleep(20 * time.Millisecond) // a queue of 10 takes 200ms, past slowAfter
		}
		i, err := strconv.Atoi(string(rec.Value))
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		switch {
		case i == next[rec.Partition]:
			next[rec.Partition]++
		case i > next[rec.Partition]:
			skipped = append(skipped, fmt.Sprintf("partition %d: record %d before %d", rec.Partition, i, next[rec.Partition]))
		}
		if rec.Partition == 1 && next[1] == n {
			fastDone <- next
		}
		return nil
	})
	var at [2]int
	select {
	case at = <-fastDone:
	case <-time.After(60 * time.Second):
		t.Fatal("the fast partition did not finish within a minute")
	}
	t.Logf("the fast partition finished when the slow one had done %d of %d", at[0], n)
	// Held back by the slow one, the fast partition would move in step with
	// it: a few records per drain of the slow queue.
	require.Less(t, at[0], n/2, "the fast partition finished only once the slow one was half done: it waited for it")
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return next[0] == n
	}, 60*time.Second, 10*time.Millisecond, "the slow partition did not finish")
	require.NoError(t, r.Stop())
	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, skipped)
	t.Logf("records fetched: partition 0 %d, partition 1 %d, of %d each", read.n[0].Load(), read.n[1].Load(), n)
	require.Less(t, read.n[0].Load(), int64(2*n), "the slow partition's records were fetched again and again")
}

// fetchCounter counts the records franz-go read from fetches, by
// partition (0 and 1).
type fetchCounter struct{ n [2]atomic.Int64 }

var _ kgo.HookFetchBatchRead = (*fetchCounter)(nil)

func (f *fetchCounter) OnFetchBatchRead(_ kgo.BrokerMetadata, _ string, partition int32, m kgo.FetchBatchMetrics) {
	if partition >= 0 && int(partition) < len(f.n) {
		f.n[partition].Add(int64(m.NumRecords))
	}
}
