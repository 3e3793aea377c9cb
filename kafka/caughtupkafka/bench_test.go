package caughtupkafka_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/latency"
)

// Throughput and per-message cost are measured here, never asserted in
// tests: make bench, or
//
//	go test -run '^$' -bench Throughput ./kafka/
//
// on the test binary's real Kafka 4.4 broker (or KAFKA_BROKERS).
// CAUGHTUP_KAFKA_BENCH_MESSAGES sets the size of the throughput runs
// (default 1,000,000 messages with a trivial handler, a tenth of that with
// a point query), CAUGHTUP_KAFKA_BENCH_ROUNDS how many runs of each
// variant (default 1; with more, medians are reported) and
// CAUGHTUP_KAFKA_BENCH_VARIANTS which variants run (benchVariants).

// quiet is a router like e.Router that records into a no-op
// MeterProvider: the routing alone.
func quiet(t testing.TB, e *env) *consume.Router {
	rc := e.Router.Config()
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
	ctx, err := e.Insert(context.Background(), stampedIDs.Add(1), "k", 0)
	require.NoError(t, err)
	require.NoError(t, e.Cluster.WaitReplicasCaughtUp(context.Background()))
	return ctx
}

// benchPartitions is the partition count of the throughput topics.
const benchPartitions = 4

// throughputTopic fills a topic of benchPartitions partitions, evenly, with
// n messages each stamped as its producer would after its own commit: a
// token of its own (a position at or below the one ctx carries, so that
// the replicas have it), so that every message's token is decoded. Each
// value is the message's index.
func throughputTopic(t testing.TB, ctx context.Context, n int) string {
	topic := kafkasuite.NewTopics(t, benchPartitions, "")[0]
	w := newWriter(t, topic)
	w.Balancer = &kafka.RoundRobin{}
	w.BatchSize = 1000
	base, ok := enqueue.TokenFrom(ctx)
	require.True(t, ok)
	e := base.Entries[0]
	batch := make([]kafka.Message, 0, 10000)
	for i := range n {
		msg := kafka.Message{Key: []byte(strconv.Itoa(i % 64)), Value: []byte(strconv.Itoa(i))}
		tok := position.New(e.Database, e.Epoch, e.LSN-position.LSN(i%4096), position.SourcePrimary, base.CapturedAt)
		require.NoError(t, caughtupkafka.Stamp(enqueue.WithToken(ctx, tok), &msg))
		batch = append(batch, msg)
		if len(batch) == cap(batch) || i == n-1 {
			require.NoError(t, w.WriteMessages(ctx, batch...))
			batch = batch[:0]
		}
	}
	return topic
}

// side is one consumer of a throughput run: a fresh group over the
// topic. Handlers wait for the gate, which opens once the group is
// stable, so that joins and rebalances are not measured; the run ends
// when every message ran at least once. The run is timed over its middle:
// from the first run of the window's first message (10% of the messages)
// to that of its last (90%), so that neither the fetch pipeline filling up
// nor a tail of partitions finishing one after another is measured, only
// the steady rate.
type side struct {
	gate     chan struct{}
	seen     []atomic.Bool
	distinct atomic.Int64
	from, to int64   // the window, in distinct messages
	marks    [2]mark // taken at from and to
	marked   sync.WaitGroup
	all      chan struct{}
	stop     func() error
}

// mark is when a side's window starts or ends, in wall-clock and in this
// process's CPU time.
type mark struct {
	at  time.Time
	cpu time.Duration
}

func newSide(n int) *side {
	sd := &side{gate: make(chan struct{}), seen: make([]atomic.Bool, n), all: make(chan struct{}),
		from: int64(n) / 10, to: int64(n) * 9 / 10}
	sd.marked.Add(len(sd.marks))
	return sd
}

// handler does nothing but get its pool, or with query runs one point
// query on it.
func (sd *side) handler(pool func(ctx context.Context) (*pgxpool.Pool, error), query bool) caughtupkafka.Handler {
	return func(ctx context.Context, msg kafka.Message) error {
		select {
		case <-sd.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		p, err := pool(ctx)
		if err != nil {
			return err
		}
		if query {
			var one int
			if err := p.QueryRow(ctx, `SELECT 1 FROM items WHERE id = $1`, 1).Scan(&one); err != nil {
				return err
			}
		}
		i, err := strconv.Atoi(string(msg.Value))
		if err != nil || i < 0 || i >= len(sd.seen) {
			return fmt.Errorf("not a throughput message: %q", msg.Value)
		}
		if !sd.seen[i].Swap(true) {
			switch sd.distinct.Add(1) {
			case sd.from:
				sd.marks[0] = mark{time.Now(), kafkasuite.ProcessCPUTime()}
				sd.marked.Done()
			case sd.to:
				sd.marks[1] = mark{time.Now(), kafkasuite.ProcessCPUTime()}
				sd.marked.Done()
			case int64(len(sd.seen)):
				close(sd.all)
			}
		}
		return nil
	}
}

// startRouted reads a whole topic of n messages with caughtup's Consumer
// routed by router under policy; the handler uses the pool it is given.
func startRouted(t testing.TB, topic string, n int, router *consume.Router, policy consume.Policy, query bool) (*side, string) {
	sd := newSide(n)
	group := kafkasuite.NewGroup(t)
	// A plain Dialer, as the plain consumer has, not startConsumer's
	// fault dialer: nothing but the consumers differs.
	r := startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, GroupID: group, Router: router, Policy: policy, CommitInterval: time.Second,
		Dialer: kafka.DefaultDialer,
	}, sd.handler(func(ctx context.Context) (*pgxpool.Pool, error) { return consume.Pool(ctx, "main") }, query))
	sd.stop = r.Stop
	return sd, group
}

// startKafkaGo reads a whole topic of n messages as a plain kafka-go
// application does: members group Readers in one group, each a loop of
// FetchMessage, handler, CommitMessages (committed every second, as the
// routed Consumer commits), with the routed Consumer's fetch settings
// (MaxWait 100ms, QueueCapacity 100, MinBytes and MaxBytes by default,
// heartbeat 200ms). With one member per partition it has the routed
// Consumer's parallelism: one loop per partition. The handler reads the
// replicas in turn, without knowing whether they have caught up.
func startKafkaGo(t testing.TB, e *env, topic string, n, members int, query bool) (*side, string) {
	sd := newSide(n)
	var turn atomic.Uint32
	h := sd.handler(func(context.Context) (*pgxpool.Pool, error) {
		return e.Replicas[int(turn.Add(1))%len(e.Replicas)], nil
	}, query)
	group := kafkasuite.NewGroup(t)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	readers := make([]*kafka.Reader, members)
	for i := range readers {
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: kafkasuite.Brokers(t), GroupID: group, Topic: topic,
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
	}
	sd.stop = sync.OnceValue(func() error {
		cancel()
		wg.Wait()
		var err error
		for _, r := range readers {
			err = errors.Join(err, r.Close())
		}
		return err
	})
	t.Cleanup(func() { _ = sd.stop() })
	return sd, group
}

// result is one run's figures.
type result struct {
	rate float64       // messages/s
	cpu  time.Duration // this process's CPU time per message
}

// run opens the gate once group is stable with members members that
// share every partition of the topic, then waits until every message ran
// and returns messages/s over the side's window, and the CPU time the
// process used meanwhile per message.
func (sd *side) run(t testing.TB, group string, members int) result {
	t.Helper()
	waitStable(t, group, members)
	close(sd.gate)
	select {
	case <-sd.all:
	case <-time.After(5 * time.Minute):
		t.Fatalf("only %d of %d messages within 5 minutes", sd.distinct.Load(), len(sd.seen))
	}
	sd.marked.Wait()
	require.NoError(t, sd.stop())
	n := sd.to - sd.from
	return result{
		rate: float64(n) / sd.marks[1].at.Sub(sd.marks[0].at).Seconds(),
		cpu:  (sd.marks[1].cpu - sd.marks[0].cpu) / time.Duration(n),
	}
}

// waitStable waits until the coordinator reports group Stable with
// members members that own every partition of the throughput topic between
// them.
func waitStable(t testing.TB, group string, members int) {
	t.Helper()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(kafkasuite.Brokers(t)...), Transport: tr, Timeout: 10 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	last := "no answer"
	for {
		fc, err := cl.FindCoordinator(ctx, &kafka.FindCoordinatorRequest{Key: group, KeyType: kafka.CoordinatorKeyTypeConsumer})
		if err == nil && fc.Error == nil {
			addr := kafka.TCP(net.JoinHostPort(fc.Coordinator.Host, strconv.Itoa(fc.Coordinator.Port)))
			var dg *kafka.DescribeGroupsResponse
			if dg, err = cl.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{Addr: addr, GroupIDs: []string{group}}); err == nil && len(dg.Groups) == 1 {
				g := dg.Groups[0]
				owned := 0
				for _, m := range g.Members {
					for _, tp := range m.MemberAssignments.Topics {
						owned += len(tp.Partitions)
					}
				}
				if g.Error == nil && g.GroupState == "Stable" && len(g.Members) == members && owned == benchPartitions {
					return
				}
				last = fmt.Sprintf("state %s, %d members owning %d partitions", g.GroupState, len(g.Members), owned)
			}
		}
		if err != nil {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			t.Fatalf("group %s never became stable with %d members (%s)", group, members, last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// variants of a throughput run.
const (
	kafkaGo    = iota // plain kafka-go: one group Reader per partition
	kafkaGoOne        // plain kafka-go: a single group Reader
	routed            // caughtup's Consumer, Policy Delayed, SDK metrics (as in production)
	routedNoop        // Policy Delayed, no-op metrics: the routing and the consumer alone
	numVariants
)

var variantNames = [numVariants]string{"kafka-go", "kafka-go-1-reader", "routed", "routed-noop-metrics"}

// measure reads one topic of n messages once per variant and round, each
// time with a fresh group, and returns each variant's runs.
//
// Each round runs the variants in an order of its own, drawn from a fixed
// seed, and each run starts once the previous one's goroutines have
// exited and the broker has had a moment for the group it left. A run
// pays for what the one before it leaves behind (a group Reader's
// goroutines winding down, the coordinator's bookkeeping for the group
// that left), and that differs by variant: in a fixed rotation one
// variant always follows the same other, and the rates shifted by 10%
// from one rotation to its reverse.
func measure(t testing.TB, e *env, n, rounds int, query bool) [numVariants][]result {
	quiet := quiet(t, e)
	topic := throughputTopic(t, stampedCtx(t, e), n)
	var got [numVariants][]result
	chosen := benchVariants(t)
	order := rand.New(rand.NewPCG(1, 2))
	idle := runtime.NumGoroutine()
	for range rounds {
		for _, v := range order.Perm(numVariants) {
			if !chosen[v] {
				continue
			}
			settle(t, idle)
			var sd *side
			var group string
			members := 1
			switch v {
			case kafkaGo:
				members = benchPartitions
				sd, group = startKafkaGo(t, e, topic, n, members, query)
			case kafkaGoOne:
				sd, group = startKafkaGo(t, e, topic, n, 1, query)
			case routed:
				sd, group = startRouted(t, topic, n, e.Router, consume.Delayed, query)
			case routedNoop:
				sd, group = startRouted(t, topic, n, quiet, consume.Delayed, query)
			}
			got[v] = append(got[v], sd.run(t, group, members))
		}
	}
	return got
}

// benchVariants are the variants to run: CAUGHTUP_KAFKA_BENCH_VARIANTS,
// comma-separated names or "all"; by default the two that the ratio
// compares, kafka-go and routed, so that each round's pair runs within
// seconds of each other (rates on 2 shared cores drift over tens of
// seconds).
func benchVariants(t testing.TB) [numVariants]bool {
	var chosen [numVariants]bool
	names := os.Getenv("CAUGHTUP_KAFKA_BENCH_VARIANTS")
	switch names {
	case "":
		names = variantNames[kafkaGo] + "," + variantNames[routed]
	case "all":
		names = strings.Join(variantNames[:], ",")
	}
	for name := range strings.SplitSeq(names, ",") {
		v := slices.Index(variantNames[:], strings.TrimSpace(name))
		if v < 0 {
			t.Fatalf("CAUGHTUP_KAFKA_BENCH_VARIANTS: no variant %q (variants: %s, or all)", name, strings.Join(variantNames[:], ", "))
		}
		chosen[v] = true
	}
	if !chosen[kafkaGo] {
		t.Fatalf("CAUGHTUP_KAFKA_BENCH_VARIANTS must include %s: every ratio is to it", variantNames[kafkaGo])
	}
	return chosen
}

// settle waits until no more than idle goroutines are left (what the
// process runs between runs: routers, pools, the test's own), or 10s,
// then gives the broker 200ms.
func settle(t testing.TB, idle int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > idle {
		if time.Now().After(deadline) {
			t.Logf("%d goroutines still running 10s after a run, %d before the first", runtime.NumGoroutine(), idle)
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	runtime.GC()
	time.Sleep(time.Second)
}

// stats are a variant's figures over its runs: the median and extreme
// rates and the median CPU time per message, and its ratios to the plain
// consumer's (kafkaGo) run of the same round, median and quartiles.
// Ratios are taken round by round because runs on 2 shared cores drift
// (the broker's and PostgreSQL's own work comes and goes): a round's
// runs follow one another within seconds, and the median of their ratios
// is steadier than the ratio of medians.
type stats struct {
	rate, slowest, fastest  float64
	cpu                     time.Duration
	ratio, ratioQ1, ratioQ3 float64 // rate / plain's rate
	cpuRatio                float64 // plain's CPU / this CPU, per message
}

// summarize returns the zero stats for a variant that did not run. Its
// medians and quartiles follow the project's one percentile rule.
func summarize(runs, plain []result) stats {
	if len(runs) == 0 {
		return stats{}
	}
	rates, cpus := make([]float64, len(runs)), make([]time.Duration, len(runs))
	ratios, cpuRatios := make([]float64, len(runs)), make([]float64, len(runs))
	for i, r := range runs {
		rates[i], cpus[i] = r.rate, r.cpu
		if plain[i].rate > 0 && r.cpu > 0 {
			ratios[i], cpuRatios[i] = r.rate/plain[i].rate, float64(plain[i].cpu)/float64(r.cpu)
		}
	}
	return stats{
		rate: latency.Percentile(rates, 0.5), slowest: slices.Min(rates), fastest: slices.Max(rates),
		cpu:   latency.Percentile(cpus, 0.5),
		ratio: latency.Percentile(ratios, 0.5), ratioQ1: latency.Percentile(ratios, 0.25), ratioQ3: latency.Percentile(ratios, 0.75),
		cpuRatio: latency.Percentile(cpuRatios, 0.5),
	}
}

func benchEnv(b *testing.B, name string, def int) int {
	if s := os.Getenv(name); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(b, err, name)
		return n
	}
	return def
}

// BenchmarkThroughput reads a topic of stamped messages whose replicas
// have caught up (4 partitions, filled evenly) with caughtup's routed
// Consumer and with a plain kafka-go consumer, and reports messages/s and
// the ratio routed/plain, with a trivial handler and with a handler that
// runs one point query on the pool it reads. The plain consumer is
// startKafkaGo with one group Reader per partition (the routed Consumer's
// parallelism); a single group Reader is shown for reference. Each run
// starts a fresh group, opens the gate once the group is stable (every
// handler waits for it) and is timed over its middle 80% of messages
// (side). The ratios are the medians of each round's ratios (stats).
func BenchmarkThroughput(b *testing.B) {
	e := setupDB(b, nil)
	n := benchEnv(b, "CAUGHTUP_KAFKA_BENCH_MESSAGES", 1_000_000)
	rounds := benchEnv(b, "CAUGHTUP_KAFKA_BENCH_ROUNDS", 1)
	for _, query := range []bool{false, true} {
		name, msgs := "trivial", n
		if query {
			name, msgs = "point-query", n/10
		}
		b.Run(name, func(b *testing.B) {
			var runs [numVariants][]result
			for b.Loop() {
				runs = measure(b, e, msgs, rounds, query)
			}
			var st [numVariants]stats
			for v := range numVariants {
				st[v] = summarize(runs[v], runs[kafkaGo])
			}
			for v := range numVariants {
				if len(runs[v]) == 0 {
					continue
				}
				b.ReportMetric(st[v].rate, variantNames[v]+"-msg/s")
				b.ReportMetric(float64(st[v].cpu.Nanoseconds()), variantNames[v]+"-cpu-ns/msg")
				if v != kafkaGo {
					b.ReportMetric(st[v].ratio, variantNames[v]+"-ratio")
				}
			}
			b.Logf("%s handler, %d messages, %d partitions, %d run(s) each:\n%s", name, msgs, benchPartitions, rounds, formatRates(st))
		})
	}
}

// formatRates is the table: each variant's median rate; its ratio to the
// plain consumer's rate in the same round, median and quartiles; the
// slowest and fastest run; and the CPU time this process spent per
// message (the test binary's, broker excluded) with its ratio,
// plain/variant, median over rounds: the throughput ratio to expect where
// the CPU is the limit, as on 2 shared cores.
func formatRates(st [numVariants]stats) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\t%-20s %10s %7s %13s %10s %10s %11s %9s\n", "consumer", "msg/s", "/plain", "quartiles", "slowest", "fastest", "cpu µs/msg", "cpu ratio")
	for v := range numVariants {
		s := st[v]
		if s.rate == 0 {
			continue // not run
		}
		fmt.Fprintf(&sb, "\t%-20s %10.0f %7.3f  %5.3f–%5.3f %10.0f %10.0f %11.2f %9.3f\n", variantNames[v], s.rate, s.ratio,
			s.ratioQ1, s.ratioQ3, s.slowest, s.fastest, float64(s.cpu.Nanoseconds())/1000, s.cpuRatio)
	}
	return sb.String()
}

// BenchmarkMiddleware is the routing decorator alone around a trivial
// handler: what each message pays for routing (token decode, decision,
// metrics, the handler's context), without Kafka.
func BenchmarkMiddleware(b *testing.B) {
	e := setupDB(b, nil)
	ctx := stampedCtx(b, e)
	msg := kafka.Message{Value: []byte("x")}
	require.NoError(b, caughtupkafka.Stamp(ctx, &msg))
	for name, router := range map[string]*consume.Router{"sdk-metrics": e.Router, "noop-metrics": quiet(b, e)} {
		h := caughtupkafka.Middleware(router, consume.Delayed)(func(ctx context.Context, msg kafka.Message) error { return nil })
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
	for name, hs := range map[string][]kafka.Header{
		"no-header":       nil,
		"existing-header": {{Key: position.HeaderName, Value: []byte(prev)}},
	} {
		msgs := []kafka.Message{{Key: []byte("k"), Value: []byte("v"), Headers: hs}}
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
	msg := kafka.Message{Value: []byte("x")}
	require.NoError(b, caughtupkafka.Stamp(enqueue.WithToken(context.Background(), tokenAt("0/16B3740")), &msg))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := caughtupkafka.TokenOf(msg); err != nil {
			b.Fatal(err)
		}
	}
}
