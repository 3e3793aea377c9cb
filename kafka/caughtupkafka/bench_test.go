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
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/latency"
)

// Throughput and per-message cost are measured here, never asserted in
// tests: make bench, or
//
//	go test -run '^$' -bench Throughput -benchtime 1x ./kafka/caughtupkafka/
//
// on the test binary's real Kafka 4.4 broker (or KAFKA_BROKERS).
// CAUGHTUP_KAFKA_BENCH_MESSAGES sets the size of the throughput runs
// (default 1,000,000 messages with a trivial handler, a tenth of that with
// a point query), CAUGHTUP_KAFKA_BENCH_ROUNDS how many runs of each
// variant (default 5; medians and ranges are reported) and
// CAUGHTUP_KAFKA_BENCH_VARIANTS which variants run (benchVariants).

// quiet is a router like router that records into a no-op
// MeterProvider: the routing alone.
func quiet(t testing.TB, router *consume.Router) *consume.Router {
	rc := router.Config()
	rc.MeterProvider = noop.NewMeterProvider()
	r, err := consume.NewRouter(context.Background(), rc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// oneReplicaRouter is a router like e's over e's first replica alone.
func oneReplicaRouter(t testing.TB, e *env) *consume.Router {
	cfg := e.Router.Config()
	db := cfg.Databases["main"]
	db.Replicas = db.Replicas[:1]
	cfg.Databases = map[string]replay.Database{"main": db}
	r, err := consume.NewRouter(context.Background(), cfg)
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
		// Not ctx, which carries base: stamping merges with what the
		// context carries, which would stamp every message with base.
		require.NoError(t, caughtupkafka.Stamp(enqueue.WithToken(context.Background(), tok), &msg))
		if i == 1 {
			require.NotEqual(t, string(batch[0].Headers[0].Value), string(msg.Headers[0].Value), "two messages stamped with one token")
		}
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
// when every message ran at least once, timed over its middle
// (kafkasuite.Window).
type side struct {
	gate chan struct{}
	w    *kafkasuite.Window
	stop func() error
}

func newSide(n int) *side {
	return &side{gate: make(chan struct{}), w: kafkasuite.NewWindow(n)}
}

// handler does nothing but get its pool (pool also names its replica),
// or with query runs one point query on it.
func (sd *side) handler(pool func(ctx context.Context) (*pgxpool.Pool, string, error), query bool) caughtupkafka.Handler {
	return func(ctx context.Context, msg kafka.Message) error {
		select {
		case <-sd.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		p, replica, err := pool(ctx)
		if err != nil {
			return err
		}
		if query {
			start := time.Now()
			var one int
			if err := p.QueryRow(ctx, `SELECT 1 FROM items WHERE id = $1`, 1).Scan(&one); err != nil {
				return err
			}
			sd.w.Busy(time.Since(start))
			sd.w.Replica(replica)
		}
		i, err := strconv.Atoi(string(msg.Value))
		if err != nil {
			return fmt.Errorf("not a throughput message: %q", msg.Value)
		}
		return sd.w.See(i)
	}
}

// routedPool is the pool the router chose and its replica's name (with
// query, which a trivial handler does not look up).
func routedPool(query bool) func(ctx context.Context) (*pgxpool.Pool, string, error) {
	return func(ctx context.Context) (*pgxpool.Pool, string, error) {
		p, err := consume.Pool(ctx, "main")
		if err != nil || !query {
			return p, "", err
		}
		d, _ := consume.DecisionFrom(ctx)
		if d.Databases[0].Replica == "" {
			return nil, "", fmt.Errorf("routed to the primary (%s): the replicas had caught up", d.Reason)
		}
		return p, d.Databases[0].Replica, nil
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
	}, sd.handler(routedPool(query), query))
	sd.stop = r.Stop
	return sd, group
}

// replicaPool is a plain reader's choice of replica: with turn, each message's
// the next one in turn (one counter for every reader); else the home-th
// replica, for every message of the reader, as the routed Consumer's
// partitions each stay on one replica (consume.Tally).
func replicaPool(rs *kafkasuite.BareReplicas, home int, turn bool) func(context.Context) (*pgxpool.Pool, string, error) {
	return func(context.Context) (*pgxpool.Pool, string, error) {
		if turn {
			p, name := rs.Next()
			return p, name, nil
		}
		p, name := rs.At(home)
		return p, name, nil
	}
}

// startKafkaGo reads a whole topic of n messages as a plain kafka-go
// application does: members group Readers in one group, each a loop of
// FetchMessage and the handler, committing (CommitMessages) the last
// message done once a second, as the routed Consumer commits, or with
// commitEach each message (kafka-go then hands every message to the
// Reader's commit goroutine, which commits every second, CommitInterval),
// with the routed Consumer's fetch settings
// (MaxWait 100ms, QueueCapacity 100, MinBytes and MaxBytes by default,
// heartbeat 200ms). With one member per partition it has the routed
// Consumer's parallelism: one loop per partition. The handler reads the
// replicas without knowing whether they have caught up: reader k the k-th
// replica, or with turn each message the next one.
func startKafkaGo(t testing.TB, rs *kafkasuite.BareReplicas, topic string, n, members int, query, turn, commitEach bool) (*side, string) {
	sd := newSide(n)
	group := kafkasuite.NewGroup(t)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	readers := make([]*kafka.Reader, members)
	for i := range readers {
		h := sd.handler(replicaPool(rs, i, turn), query)
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: kafkasuite.Brokers(t), GroupID: group, Topic: topic,
			MaxWait: 100 * time.Millisecond, QueueCapacity: caughtupkafka.DefaultQueueCapacity,
			CommitInterval: time.Second, HeartbeatInterval: 200 * time.Millisecond,
		})
		readers[i] = r
		wg.Go(func() {
			committed := time.Now()
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
				if commitEach || time.Since(committed) >= time.Second {
					_ = r.CommitMessages(ctx, msg)
					committed = time.Now()
				}
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

// run opens the gate once group is stable with members members that
// share every partition of the topic, then waits until every message ran
// and returns the side's window.
func (sd *side) run(t testing.TB, group string, members int) kafkasuite.Result {
	t.Helper()
	waitStable(t, group, members)
	close(sd.gate)
	res := sd.w.Wait(t, 5*time.Minute)
	require.NoError(t, sd.stop())
	return res
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
	kafkaGo           = iota // plain kafka-go: one group Reader per partition, committing once a second
	kafkaGoCommitEach        // the same, CommitMessages after each message
	kafkaGoOne               // plain kafka-go: a single group Reader
	routed                   // caughtup's Consumer, Policy Delayed, SDK metrics (as in production)
	routedNoop               // Policy Delayed, no-op metrics: the routing and the consumer alone
	numVariants
)

var variantNames = [numVariants]string{"kafka-go", "kafka-go-commit-each", "kafka-go-1-reader", "routed", "routed-noop-metrics"}

// row is one table row of BenchmarkThroughput: a handler and the
// replicas both sides read.
type row struct {
	name   string
	query  bool
	router *consume.Router // the routed side's
	turn   bool            // the plain side reads the replicas in turn, message by message
}

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
func measure(t testing.TB, e *env, topic string, n, rounds int, rw row) [numVariants][]kafkasuite.Result {
	quiet := quiet(t, rw.router)
	rs := kafkasuite.NewBareReplicas(t, e, rw.router)
	var got [numVariants][]kafkasuite.Result
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
			case kafkaGo, kafkaGoCommitEach:
				members = benchPartitions
				sd, group = startKafkaGo(t, rs, topic, n, members, rw.query, rw.turn, v == kafkaGoCommitEach)
			case kafkaGoOne:
				sd, group = startKafkaGo(t, rs, topic, n, 1, rw.query, rw.turn, false)
			case routed:
				sd, group = startRouted(t, topic, n, rw.router, consume.Delayed, rw.query)
			case routedNoop:
				sd, group = startRouted(t, topic, n, quiet, consume.Delayed, rw.query)
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
	if !chosen[kafkaGo] && os.Getenv("CAUGHTUP_KAFKA_BENCH_VARIANTS") != variantNames[routed] {
		t.Fatalf("CAUGHTUP_KAFKA_BENCH_VARIANTS must include %s: every ratio is to it (or be %s alone, for a profile)", variantNames[kafkaGo], variantNames[routed])
	}
	return chosen
}

// settle waits until no more than idle goroutines are left (what the
// process runs between runs: routers, pools, the test's own), or 10s,
// then gives the broker a second.
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

func benchEnv(b *testing.B, name string, def int) int {
	if s := os.Getenv(name); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(b, err, name)
		return n
	}
	return def
}

// BenchmarkThroughput reads a topic of stamped messages whose replicas
// have caught up (4 partitions, filled evenly, a token per message) with
// caughtup's routed Consumer and with a plain kafka-go consumer, and
// reports messages/s, CPU per message and their ratios routed/plain
// (plain/routed for CPU), each round's ratio, median and range. The plain
// consumer is startKafkaGo with one group Reader per partition (the
// routed Consumer's parallelism), committing once a second as the routed
// Consumer does; the same committing after each message (as kafka-go's
// examples do), a single group Reader, and the routed Consumer on a no-op
// MeterProvider are shown for reference (CAUGHTUP_KAFKA_BENCH_VARIANTS,
// all). Each run starts a fresh
// group, opens the gate once the group is stable (every handler waits
// for it) and is timed over its middle 80% of messages. The rows:
//
//   - trivial: the handler only gets its pool;
//   - point-query/one-replica: one point query per message, the router
//     over one replica and the plain side reading that replica;
//   - point-query/spread: over both replicas, each routed partition's
//     worker on one replica (consume.Tally) and each plain Reader on one;
//   - point-query/spread-turns: the same router against plain Readers
//     that read the replicas in turn, message by message.
//
// Both sides read through pools of the same size built from the same
// configs (the router's handler pools, the plain side's own).
func BenchmarkThroughput(b *testing.B) {
	e := setupDB(b, nil)
	n := benchEnv(b, "CAUGHTUP_KAFKA_BENCH_MESSAGES", 1_000_000)
	rounds := benchEnv(b, "CAUGHTUP_KAFKA_BENCH_ROUNDS", 5)
	ctx := stampedCtx(b, e)
	one := oneReplicaRouter(b, e)
	var trivial, query string
	for _, rw := range []row{
		{name: "trivial", router: e.Router},
		{name: "point-query/one-replica", query: true, router: one},
		{name: "point-query/spread", query: true, router: e.Router},
		{name: "point-query/spread-turns", query: true, router: e.Router, turn: true},
	} {
		b.Run(rw.name, func(b *testing.B) {
			msgs, topic := n, &trivial
			if rw.query {
				msgs, topic = n/10, &query
			}
			if *topic == "" {
				*topic = throughputTopic(b, ctx, msgs)
			}
			var runs [numVariants][]kafkasuite.Result
			for b.Loop() {
				runs = measure(b, e, *topic, msgs, rounds, rw)
			}
			for v := range numVariants {
				if len(runs[v]) == 0 {
					continue
				}
				b.ReportMetric(latency.Percentile(of(runs[v], msgRate), 0.5), variantNames[v]+"-msg/s")
				b.ReportMetric(latency.Percentile(of(runs[v], cpu), 0.5), variantNames[v]+"-cpu-ns/msg")
				if v != kafkaGo && len(runs[kafkaGo]) > 0 {
					b.ReportMetric(latency.Percentile(ratios(runs[v], runs[kafkaGo], msgRate, false), 0.5), variantNames[v]+"-ratio")
				}
			}
			b.Logf("%s, %d messages, %d partitions, %d round(s) (median (min–max)):\n%s", rw.name, msgs, benchPartitions, rounds, formatRates(runs, rw.query))
		})
	}
}

var (
	msgRate = func(r kafkasuite.Result) float64 { return r.Rate }
	cpu     = func(r kafkasuite.Result) float64 { return float64(r.CPU.Nanoseconds()) }
	machine = func(r kafkasuite.Result) float64 { return float64(r.Machine.Nanoseconds()) }
	busy    = func(r kafkasuite.Result) float64 { return r.Busy }
	flight  = func(r kafkasuite.Result) float64 { return r.InFlight }
)

// of maps results to one figure each.
func of(rs []kafkasuite.Result, f func(kafkasuite.Result) float64) []float64 {
	out := make([]float64, len(rs))
	for i, r := range rs {
		out[i] = f(r)
	}
	return out
}

// ratios are each round's runs/plain of f, or plain/runs with inv (for
// costs, so that a figure below 1 means the variant costs more). Ratios
// are taken round by round because runs on 2 shared cores drift (the
// broker's and PostgreSQL's own work comes and goes): a round's runs
// follow one another within seconds.
func ratios(runs, plain []kafkasuite.Result, f func(kafkasuite.Result) float64, inv bool) []float64 {
	out := make([]float64, 0, len(runs))
	for i := range runs {
		if i >= len(plain) {
			break
		}
		p, r := f(plain[i]), f(runs[i])
		if inv {
			p, r = r, p
		}
		if p > 0 {
			out = append(out, r/p)
		}
	}
	return out
}

// formatRates is the table: each variant's rate, its ratio to the plain
// consumer's rate in the same round, the CPU time this process and the
// machine spent per message with their ratios plain/variant (the
// throughput ratio to expect where the CPU is the limit, as on 2 shared
// cores), how busy the cores were, and with query how many queries ran
// at once and each replica's share.
func formatRates(runs [numVariants][]kafkasuite.Result, query bool) string {
	var sb strings.Builder
	for v := range numVariants {
		rs := runs[v]
		if len(rs) == 0 {
			continue
		}
		fmt.Fprintf(&sb, "\t%-19s msg/s %s", variantNames[v], kafkasuite.Spread3("%.0f", of(rs, msgRate)))
		if v != kafkaGo && len(runs[kafkaGo]) > 0 {
			fmt.Fprintf(&sb, " ratio %s", kafkasuite.Spread3("%.3f", ratios(rs, runs[kafkaGo], msgRate, false)))
		}
		fmt.Fprintf(&sb, "; CPU ns/msg process %s", kafkasuite.Spread3("%.0f", of(rs, cpu)))
		if v != kafkaGo && len(runs[kafkaGo]) > 0 {
			fmt.Fprintf(&sb, " ratio %s", kafkasuite.Spread3("%.3f", ratios(rs, runs[kafkaGo], cpu, true)))
		}
		fmt.Fprintf(&sb, ", machine %s", kafkasuite.Spread3("%.0f", of(rs, machine)))
		if v != kafkaGo && len(runs[kafkaGo]) > 0 {
			fmt.Fprintf(&sb, " ratio %s", kafkasuite.Spread3("%.3f", ratios(rs, runs[kafkaGo], machine, true)))
		}
		fmt.Fprintf(&sb, "; cores busy %s", kafkasuite.Spread3("%.2f", of(rs, busy)))
		if query {
			fmt.Fprintf(&sb, "; queries at once %s; replicas %s", kafkasuite.Spread3("%.2f", of(rs, flight)), kafkasuite.Spread(rs))
		}
		sb.WriteString("\n")
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
	for name, router := range map[string]*consume.Router{"sdk-metrics": e.Router, "noop-metrics": quiet(b, e.Router)} {
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
