package kafka_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	caughtupkafka "github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// Throughput and per-message cost are measured here, never asserted in
// tests: make bench, or
//
//	go test -run '^$' -bench . ./kafka/
//
// CAUGHTUP_KAFKA_BENCH_MESSAGES sets the size of the throughput runs
// (default 20,000 messages with a trivial handler, a quarter of that with
// a point query).

// quiet is a router like e.router that records into a no-op
// MeterProvider: the routing alone.
func (e *env) quiet(t testing.TB) *consume.Router {
	rc := e.router.Config()
	rc.MeterProvider = noop.NewMeterProvider()
	r, err := consume.NewRouter(context.Background(), rc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

var stampedIDs atomic.Int64

// stampedCtx commits one insert and waits until the replicas have it:
// every message stamped with its token then runs on a replica without
// waiting, so the comparison measures the consumer's and the router's
// cost, not replication lag.
func stampedCtx(t testing.TB, e *env) context.Context {
	ctx, err := e.insert(context.Background(), stampedIDs.Add(1), "k", 0)
	require.NoError(t, err)
	require.NoError(t, e.c.WaitReplicasCaughtUp(context.Background()))
	return ctx
}

// throughputTopic fills a 4-partition topic with n messages stamped with
// the token ctx carries.
func throughputTopic(t testing.TB, ctx context.Context, n int) string {
	topic := newTopics(t, 4, "")[0]
	w := caughtupkafka.NewWriter(newWriter(t, topic))
	batch := make([]kafkago.Message, 0, 1000)
	for i := range n {
		batch = append(batch, kafkago.Message{Key: []byte(strconv.Itoa(i % 64)), Value: []byte(strconv.Itoa(i))})
		if len(batch) == cap(batch) || i == n-1 {
			require.NoError(t, w.WriteMessages(ctx, batch...))
			batch = batch[:0]
		}
	}
	return topic
}

// side is one consumer of a throughput round: a fresh group over the
// topic and the completion time of each message.
type side struct {
	done []int64
	n    atomic.Int64
	all  chan struct{}
	stop func() error
}

func newSide(n int) *side { return &side{done: make([]int64, n), all: make(chan struct{})} }

// handler does nothing, or with query one point query on pool.
func (sd *side) handler(pool func(ctx context.Context) (*pgxpool.Pool, error), query bool) caughtupkafka.Handler {
	return func(ctx context.Context, msg kafkago.Message) error {
		p, err := pool(ctx)
		if err != nil {
			return err
		}
		if query {
			var one int
			if err := p.QueryRow(ctx, `SELECT 1 FROM items WHERE id = (SELECT min(id) FROM items)`).Scan(&one); err != nil {
				return err
			}
		}
		if i := sd.n.Add(1); i <= int64(len(sd.done)) {
			sd.done[i-1] = time.Now().UnixNano()
			if i == int64(len(sd.done)) {
				close(sd.all)
			}
		}
		return nil
	}
}

// startRouted reads a whole topic of n messages with caughtup's Consumer
// routed by router under policy; the handler uses the pool it is given.
func startRouted(t testing.TB, topic string, n int, router *consume.Router, policy consume.Policy, query bool) *side {
	sd := newSide(n)
	r := startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, Router: router, Policy: policy, CommitInterval: time.Second,
	}, sd.handler(func(ctx context.Context) (*pgxpool.Pool, error) { return consume.Pool(ctx, "main") }, query))
	sd.stop = r.stop
	return sd
}

// startKafkaGo reads a whole topic of n messages as a plain kafka-go
// application does, with a group Reader (fetch, handle, commit
// asynchronously every second); the handler uses the primary.
func startKafkaGo(t testing.TB, e *env, topic string, n int, query bool) *side {
	sd := newSide(n)
	h := sd.handler(func(context.Context) (*pgxpool.Pool, error) { return e.primary, nil }, query)
	r := kafkago.NewReader(kafkago.ReaderConfig{
		Brokers: brokers(t), GroupID: newGroup(t), Topic: topic,
		MaxWait: 100 * time.Millisecond, CommitInterval: time.Second, HeartbeatInterval: 200 * time.Millisecond,
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			msg, err := r.FetchMessage(ctx)
			if err != nil {
				return
			}
			for h(ctx, msg) != nil {
				select {
				case <-ctx.Done():
					return
				case <-time.After(10 * time.Millisecond):
				}
			}
			_ = r.CommitMessages(ctx, msg)
		}
	})
	sd.stop = sync.OnceValue(func() error {
		cancel()
		wg.Wait()
		return r.Close()
	})
	t.Cleanup(func() { _ = sd.stop() })
	return sd
}

func (sd *side) wait(t testing.TB) {
	select {
	case <-sd.all:
	case <-time.After(5 * time.Minute):
		t.Fatalf("only %d of %d messages within 5 minutes", sd.n.Load(), len(sd.done))
	}
	require.NoError(t, sd.stop())
}

// rate is how many messages per second sd completed, between its first
// and its last completion.
func (sd *side) rate() float64 {
	from, to := slices.Min(sd.done), slices.Max(sd.done)
	return float64(len(sd.done)) / time.Duration(to-from).Seconds()
}

// variants of a throughput round.
const (
	kafkaGo    = iota // plain kafka-go group Reader
	always            // caughtup's Consumer, Policy Always: its machinery, no replica choice
	routed            // Policy Delayed, metrics into an SDK MeterProvider (as in production)
	routedNoop        // Policy Delayed, no-op metrics: the routing alone
	numVariants
)

var variantNames = [numVariants]string{"kafka-go", "always", "routed", "routed-noop-metrics"}

// measure reads one topic of n messages again and again with fresh
// groups, one variant after the other in rotating order, and returns each
// variant's median rate in messages/s over the rounds.
func measure(t testing.TB, e *env, n, rounds int, query bool) [numVariants]float64 {
	quiet := e.quiet(t)
	topic := throughputTopic(t, stampedCtx(t, e), n)
	var got [numVariants][]float64
	for round := range rounds {
		for k := range numVariants {
			v := (round + k) % numVariants
			var sd *side
			switch v {
			case kafkaGo:
				sd = startKafkaGo(t, e, topic, n, query)
			case always:
				sd = startRouted(t, topic, n, quiet, consume.Always, query)
			case routed:
				sd = startRouted(t, topic, n, e.router, consume.Delayed, query)
			case routedNoop:
				sd = startRouted(t, topic, n, quiet, consume.Delayed, query)
			}
			sd.wait(t)
			got[v] = append(got[v], sd.rate())
		}
	}
	var med [numVariants]float64
	for v := range numVariants {
		s := slices.Clone(got[v])
		slices.Sort(s)
		med[v] = s[len(s)/2]
	}
	return med
}

func benchMessages(b *testing.B) int {
	if s := os.Getenv("CAUGHTUP_KAFKA_BENCH_MESSAGES"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(b, err, "CAUGHTUP_KAFKA_BENCH_MESSAGES")
		return n
	}
	return 20000
}

// BenchmarkThroughput reads a 4-partition topic of stamped messages whose
// replicas have caught up, three rounds per variant, and reports each
// variant's median messages/s and its ratio to the plain kafka-go
// consumer, with a trivial handler and with a handler that runs one point
// query. On the in-process broker a trivial handler costs microseconds per
// message, so its ratios show the consumer's and the router's own costs
// almost undiluted; any I/O in the handler dilutes them.
func BenchmarkThroughput(b *testing.B) {
	e := setupDB(b, nil)
	for _, query := range []bool{false, true} {
		name, n := "trivial", benchMessages(b)
		if query {
			name, n = "point-query", n/4
		}
		b.Run(name, func(b *testing.B) {
			var r [numVariants]float64
			for b.Loop() {
				r = measure(b, e, n, 3, query)
			}
			for v := range numVariants {
				b.ReportMetric(r[v], variantNames[v]+"-msg/s")
				if v != kafkaGo {
					b.ReportMetric(r[v]/r[kafkaGo], variantNames[v]+"-ratio")
				}
			}
			b.Logf("%s handler, %d messages, 4 partitions, median of 3 rounds: %s", name, n, formatRates(r))
		})
	}
}

func formatRates(r [numVariants]float64) string {
	s := fmt.Sprintf("%s %.0f msg/s", variantNames[kafkaGo], r[kafkaGo])
	for v := kafkaGo + 1; v < numVariants; v++ {
		s += fmt.Sprintf(", %s %.0f msg/s (%.3f)", variantNames[v], r[v], r[v]/r[kafkaGo])
	}
	return s
}

// BenchmarkMiddleware is the routing decorator alone around a trivial
// handler: what each message pays for routing (token decode, decision,
// metrics, the handler's context), without Kafka.
func BenchmarkMiddleware(b *testing.B) {
	e := setupDB(b, nil)
	ctx := stampedCtx(b, e)
	msg := kafkago.Message{Value: []byte("x")}
	require.NoError(b, caughtupkafka.Stamp(ctx, &msg))
	for name, router := range map[string]*consume.Router{"sdk-metrics": e.router, "noop-metrics": e.quiet(b)} {
		h := caughtupkafka.Middleware(router, consume.Delayed)(func(ctx context.Context, msg kafkago.Message) error { return nil })
		require.Eventually(b, func() bool { return h(context.Background(), msg) == nil }, 5*time.Second, 10*time.Millisecond)
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := h(context.Background(), msg); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkStamped is the producer's cost per message: merging the
// context's token into messages without a token header, and into one
// that already carries one.
func BenchmarkStamped(b *testing.B) {
	tok := position.New("main", epoch, position.MustParseLSN("0/16B3740"), position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
	ctx := enqueue.WithToken(context.Background(), tok)
	prev, err := tokenAt("0/1000", "billing").Encode()
	require.NoError(b, err)
	for name, hs := range map[string][]kafkago.Header{
		"no-header":       nil,
		"existing-header": {{Key: position.HeaderName, Value: []byte(prev)}},
	} {
		msgs := []kafkago.Message{{Key: []byte("k"), Value: []byte("v"), Headers: hs}}
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := caughtupkafka.Stamped(ctx, msgs); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkTokenOf is the consumer's cost of reading a message's token.
func BenchmarkTokenOf(b *testing.B) {
	msg := kafkago.Message{Value: []byte("x")}
	require.NoError(b, caughtupkafka.Stamp(enqueue.WithToken(context.Background(), tokenAt("0/16B3740")), &msg))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := caughtupkafka.TokenOf(msg); err != nil {
			b.Fatal(err)
		}
	}
}
