package caughtupkafka_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/catchup"
	"github.com/caughtup/caughtup/testkit/drain"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/latency"
)

// BenchmarkDrain measures how fast N messages held back by lag start once
// they all become runnable at once (issue #27), against plain kafka-go
// starting N messages on the same partitions that become runnable at
// once, for N = 1,000, 5,000 and 10,000 (or CAUGHTUP_DRAIN_N,
// comma-separated), with a trivial handler and one that sleeps 1ms. Each
// round runs the three sides one after the other, in a rotating order
// (CAUGHTUP_DRAIN_ROUNDS rounds, default 3), each on a fresh topic of
// benchPartitions partitions and a fresh group whose members own every
// partition before the messages are written:
//
//   - caughtup: the Consumer in InPlace mode (router defaults), every
//     replica's replay paused, N messages stamped with tokens written
//     during the pause (a row per 100 messages, as an outbox relay's
//     batches or one transaction's events share a position), so that each
//     partition's head waits for a replica; then replay resumes. Time:
//     from the catch-up of the newest token (catchup.FirstCaughtUp,
//     CatchUp.Read) to the last handler start.
//   - bare: one plain kafka-go group Reader per partition (FetchMessage,
//     handler, CommitMessages), whose handlers hold on a gate until all N
//     messages are written; then the gate opens. Time: from the gate's
//     opening to the last handler start. It reads the same messages as
//     the caughtup side, token headers included (tokens of rows written
//     just before), so that the two differ in what the consumer does with
//     them only.
//   - bare, unstamped: bare with messages that carry no header. kafka-go
//     spends a few hundred nanoseconds and bytes more on a message with a
//     token header than on one without; the ratio against this side says
//     what carrying a token costs a drain besides routing.
//
// Every side commits every second, fetches with MaxWait 100ms and
// QueueCapacity 100. The table gives each side's median over the rounds
// and the medians of the rounds' ratios bare/caughtup (≥ 0.9 is the goal).
// Handler starts not on a replica or before their token's catch-up count
// as stale (must be 0). It asserts nothing about time. Run it alone (it
// takes minutes):
//
//	go test -run '^$' -bench Drain -benchtime 1x -timeout 30m ./kafka/caughtupkafka/
func BenchmarkDrain(b *testing.B) {
	e := setupDB(b, nil)
	ns := drain.Sizes(b)
	rounds := drain.Rounds(b)
	type cell struct {
		n                         int
		handler                   string
		caughtup, bare, unstamped []time.Duration
		ratios, unstampedRatios   []float64
		stale                     int
	}
	var cells []cell
	for b.Loop() {
		cells = cells[:0]
		for _, n := range ns {
			for _, hd := range []time.Duration{0, time.Millisecond} {
				c := cell{n: n, handler: "trivial"}
				if hd > 0 {
					c.handler = "1 ms"
				}
				for r := range rounds {
					var ct, bt, ut time.Duration
					var stale int
					drain.RunSides(r,
						func() { ct, stale = drainCaughtup(b, e, n, hd) },
						func() { bt = drainBare(b, n, hd, drainTokens(b, e, n)) },
						func() { ut = drainBare(b, n, hd, nil) },
					)
					c.caughtup = append(c.caughtup, ct)
					c.bare = append(c.bare, bt)
					c.unstamped = append(c.unstamped, ut)
					c.ratios = append(c.ratios, float64(bt)/float64(ct))
					c.unstampedRatios = append(c.unstampedRatios, float64(ut)/float64(ct))
					c.stale += stale
				}
				cells = append(cells, c)
			}
		}
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "\n| kafka InPlace, %d partitions | N | handler | caughtup: catch-up → last start (median) | bare: gate → last start (median) | ratio bare/caughtup (median; min–max) | bare, unstamped (median) | ratio unstamped/caughtup (median; min–max) | rounds | stale |\n|---|---|---|---|---|---|---|---|---|---|\n", benchPartitions)
	for _, c := range cells {
		fmt.Fprintf(&tb, "| kafka | %d | %s | %v | %v | %.2f (%.2f–%.2f) | %v | %.2f (%.2f–%.2f) | %d | %d |\n", c.n, c.handler,
			median(c.caughtup), median(c.bare), drain.Median(c.ratios), slices.Min(c.ratios), slices.Max(c.ratios),
			median(c.unstamped), drain.Median(c.unstampedRatios), slices.Min(c.unstampedRatios), slices.Max(c.unstampedRatios),
			len(c.ratios), c.stale)
		h := strings.ReplaceAll(c.handler, " ", "")
		b.ReportMetric(drain.Median(c.ratios), fmt.Sprintf("ratio-%d-%s", c.n, h))
		b.ReportMetric(drain.Median(c.unstampedRatios), fmt.Sprintf("ratio-unstamped-%d-%s", c.n, h))
	}
	b.Log(tb.String())
}

// median is the median of d, to the 100 µs.
func median(d []time.Duration) time.Duration {
	return latency.Percentile(d, 0.5).Round(100 * time.Microsecond)
}

// drainTokens returns the tokens of rows written now, one per 100 of n
// messages, for writeDrain.
func drainTokens(b *testing.B, e *env, n int) []position.Token {
	ctx := context.Background()
	toks := make([]position.Token, (n+99)/100)
	for k := range toks {
		pctx, err := e.Insert(ctx, stampedIDs.Add(1), "drain", k)
		require.NoError(b, err)
		toks[k], _ = enqueue.TokenFrom(pctx)
	}
	return toks
}

// drainTopic is a fresh topic of benchPartitions partitions and a writer
// that spreads messages over them evenly.
func drainTopic(b *testing.B) (string, *kafka.Writer) {
	topic := kafkasuite.NewTopics(b, benchPartitions, "", ".dlt")[0]
	w := newWriter(b, topic)
	w.Balancer = &kafka.RoundRobin{}
	w.BatchSize = 1000
	return topic, w
}

// writeDrain writes n messages (value: the index), message i stamped with
// toks[i/100] if toks is not nil.
func writeDrain(b *testing.B, w *kafka.Writer, n int, toks []position.Token) {
	ctx := context.Background()
	batch := make([]kafka.Message, 0, 1000)
	for i := range n {
		msg := kafka.Message{Key: []byte(strconv.Itoa(i % 64)), Value: []byte(strconv.Itoa(i))}
		if toks != nil {
			require.NoError(b, caughtupkafka.Stamp(enqueue.WithToken(ctx, toks[i/100]), &msg))
		}
		batch = append(batch, msg)
		if len(batch) == cap(batch) || i == n-1 {
			require.NoError(b, w.WriteMessages(ctx, batch...))
			batch = batch[:0]
		}
	}
}

// drainCaughtup runs the caughtup side of one round.
func drainCaughtup(b *testing.B, e *env, n int, work time.Duration) (time.Duration, int) {
	ctx := context.Background()
	topic, w := drainTopic(b)
	st := drain.NewStarts(n)
	var stale atomic.Int64
	group := kafkasuite.NewGroup(b)
	warm := make(chan struct{})
	var warmOnce sync.Once
	c := startConsumer(b, caughtupkafka.ConsumerConfig{
		Topic: topic, GroupID: group, Router: e.Router, Policy: consume.Delayed, CommitInterval: time.Second,
		Dialer: kafka.DefaultDialer, MeterProvider: e.MP,
	}, func(ctx context.Context, msg kafka.Message) error {
		at := time.Now()
		if string(msg.Value) == "warm" {
			warmOnce.Do(func() { close(warm) })
			return nil
		}
		i, err := strconv.Atoi(string(msg.Value))
		if err != nil {
			return err
		}
		if d, ok := consume.DecisionFrom(ctx); !ok || d.Outcome != consume.OutcomeReplica && d.Outcome != consume.OutcomeReplicaWaited {
			stale.Add(1)
		}
		st.Start(i, at)
		if work > 0 {
			time.Sleep(work)
		}
		return nil
	})
	defer func() { require.NoError(b, c.Stop()) }()
	waitStable(b, group, 1)
	// One message per partition first, so that every partition reader
	// runs before the clock starts.
	for range benchPartitions {
		require.NoError(b, w.WriteMessages(ctx, kafka.Message{Value: []byte("warm")}))
	}
	select {
	case <-warm:
	case <-time.After(time.Minute):
		b.Fatal("the warm-up messages did not run within a minute")
	}

	for _, nd := range e.Cluster.Replicas() {
		require.NoError(b, nd.PauseReplay(ctx))
	}
	resumed := false
	defer func() {
		if !resumed {
			for _, nd := range e.Cluster.Replicas() {
				_ = nd.ResumeReplay(context.Background())
			}
		}
	}()
	toks := drainTokens(b, e, n)
	newest := toks[len(toks)-1]
	writeDrain(b, w, n, toks)
	// Let the readers fetch and every partition's head wait.
	time.Sleep(time.Second)
	if started := st.Started(); started > 0 {
		b.Fatalf("caughtup side: %d messages ran while every replica was paused", started)
	}
	runtime.GC()
	stopFollow := latency.Follow(e.Router.Snapshot)
	for _, nd := range e.Cluster.Replicas() {
		require.NoError(b, nd.ResumeReplay(ctx))
	}
	resumed = true
	st.Wait(b, "caughtup side")
	recorded := stopFollow()
	cfg := e.Router.Config()
	caught, ok := catchup.FirstCaughtUp(newest, recorded, &cfg)
	require.True(b, ok, "the recorded snapshots never show the newest token caught up")
	bad := int(stale.Load())
	for i := range n {
		if cu, ok := catchup.FirstCaughtUp(toks[i/100], recorded, &cfg); !ok || st.At(i).Before(cu.Read) {
			bad++
		}
	}
	return st.Last().Sub(caught.Read), bad
}

// drainBare runs a bare side of one round: a plain kafka-go group Reader
// per partition, as startKafkaGo, on n messages stamped with toks (as
// writeDrain; nil: unstamped).
func drainBare(b *testing.B, n int, work time.Duration, toks []position.Token) time.Duration {
	topic, w := drainTopic(b)
	st := drain.NewStarts(n)
	gate := make(chan struct{})
	group := kafkasuite.NewGroup(b)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	readers := make([]*kafka.Reader, benchPartitions)
	for i := range readers {
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: kafkasuite.Brokers(b), GroupID: group, Topic: topic,
			MaxWait: 100 * time.Millisecond, QueueCapacity: caughtupkafka.DefaultQueueCapacity,
			CommitInterval: time.Second, HeartbeatInterval: 200 * time.Millisecond,
		})
		readers[i] = r
		wg.Go(func() {
			for {
				msg, err := r.FetchMessage(ctx)
				if err != nil {
					return
				}
				select {
				case <-gate:
				case <-ctx.Done():
					return
				}
				at := time.Now()
				if i, err := strconv.Atoi(string(msg.Value)); err == nil {
					st.Start(i, at)
					if work > 0 {
						time.Sleep(work)
					}
				}
				_ = r.CommitMessages(ctx, msg)
			}
		})
	}
	stop := func() error {
		cancel()
		wg.Wait()
		var err error
		for _, r := range readers {
			err = errors.Join(err, r.Close())
		}
		return err
	}
	defer func() { require.NoError(b, stop()) }()
	waitStable(b, group, benchPartitions)
	writeDrain(b, w, n, toks)
	time.Sleep(time.Second)
	runtime.GC()
	t0 := time.Now()
	close(gate)
	st.Wait(b, "bare side")
	return st.Last().Sub(t0)
}
