package caughtupkgo_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/latency"
)

// Throughput is measured here, never asserted in tests:
//
//	go test -run '^$' -bench Throughput -benchtime 1x ./kafka/caughtupkgo/
//
// on the test binary's real Kafka 4.4 broker (or KAFKA_BROKERS).
// CAUGHTUP_KGO_BENCH_RECORDS sets the size of the trivial handler's
// topics (default 2,000,000 records: with fewer, a side's window is a
// few tenths of a second), CAUGHTUP_KGO_BENCH_QUERY_RECORDS that of the
// point query's (default 100,000), CAUGHTUP_KGO_BENCH_ROUNDS how many
// runs of each side (default 5). Ratios are taken round by round (both
// sides run back to back, in alternating order, since rates on 2 shared
// cores drift over tens of seconds) and reported as the median and range
// of the rounds' ratios.

// benchPartitions is the partition count of the throughput topics.
const benchPartitions = 4

var stampedIDs atomic.Int64

// stampedCtx commits one insert and waits until the replicas have it:
// every record stamped with its token then runs on a replica without
// waiting, so the comparison measures the consumer's and the router's
// cost, not replication lag.
func stampedCtx(t testing.TB, e *env) context.Context {
	ctx, err := e.Insert(context.Background(), 1_000_000_000+stampedIDs.Add(1), "k", 0)
	require.NoError(t, err)
	require.NoError(t, e.Cluster.WaitReplicasCaughtUp(context.Background()))
	return ctx
}

// throughputTopic fills a topic of benchPartitions partitions with n
// records stamped as their producers would after their commits, in runs
// of run records that share a token (one transaction's events, an outbox
// relay's batch stamped with one position), each run in one partition
// and the runs dealt to the partitions in turn; run 1 gives every record
// a token of its own. Tokens name positions at or below the one ctx
// carries, so that the replicas have them. Each value is the record's
// index.
func throughputTopic(t testing.TB, ctx context.Context, n, run int) string {
	topic := kafkasuite.NewTopics(t, benchPartitions, "")[0]
	cl := newClient(t, kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	base, ok := enqueue.TokenFrom(ctx)
	require.True(t, ok)
	e := base.Entries[0]
	batch := make([]*kgo.Record, 0, 10000)
	var first string
	for i := range n {
		r := &kgo.Record{Key: []byte(strconv.Itoa(i % 64)), Value: []byte(strconv.Itoa(i)), Partition: int32(i / run % benchPartitions)}
		tok := position.New(e.Database, e.Epoch, e.LSN-position.LSN(i/run%4096), position.SourcePrimary, base.CapturedAt)
		// Not ctx, which carries base: stamping merges with what the
		// context carries, which would stamp every record with base.
		require.NoError(t, caughtupkgo.Stamp(enqueue.WithToken(context.Background(), tok), r))
		switch h := string(r.Headers[0].Value); i {
		case 0:
			first = h
		case run:
			require.NotEqual(t, first, h, "two runs stamped with one token")
		}
		batch = append(batch, r)
		if len(batch) == cap(batch) || i == n-1 {
			require.NoError(t, cl.ProduceSync(ctx, batch...).FirstErr())
			batch = batch[:0]
		}
	}
	return topic
}

// side is one consumer of a throughput run, over a fresh group.
type side struct {
	w *kafkasuite.Window
	// query: the handler reads a row (a point query on the pool it got),
	// as most real handlers do, rather than nothing.
	query bool
}

func newSide(n int, query bool) *side { return &side{w: kafkasuite.NewWindow(n), query: query} }

// handle reads a row on p if sd.query, noting its replica and how long
// it took, and notes the record.
func (sd *side) handle(ctx context.Context, r *kgo.Record, p *pgxpool.Pool, replica string) error {
	i, err := strconv.Atoi(string(r.Value))
	if err != nil {
		return fmt.Errorf("not a throughput record: %q", r.Value)
	}
	if sd.query {
		start := time.Now()
		var n int
		if err := p.QueryRow(ctx, `SELECT count(*) FROM items WHERE id = $1`, i).Scan(&n); err != nil {
			return err
		}
		sd.w.Busy(time.Since(start))
		sd.w.Replica(replica)
	}
	return sd.w.See(i)
}

// fetchOpts are both sides' client settings.
func fetchOpts(t testing.TB) []kgo.Opt {
	return []kgo.Opt{kgo.SeedBrokers(kafkasuite.Brokers(t)...), kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}
}

// runPlain reads the topic as a plain franz-go application with a
// trivial handler does: one group client, a loop of PollFetches and the
// handler on each record, autocommit.
func runPlain(t testing.TB, rs *kafkasuite.BareReplicas, topic string, n int) kafkasuite.Result {
	sd := newSide(n, false)
	cl, err := kgo.NewClient(append(fetchOpts(t), kgo.ConsumerGroup(kafkasuite.NewGroup(t)), kgo.ConsumeTopics(topic))...)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			if fs.IsClientClosed() || ctx.Err() != nil {
				return
			}
			fs.EachRecord(func(r *kgo.Record) {
				p, name := rs.Next()
				if err := sd.handle(ctx, r, p, name); err != nil {
					t.Error(err)
				}
			})
		}
	}()
	res := sd.w.Wait(t, 5*time.Minute)
	cancel()
	<-done
	cl.Close()
	return res
}

// runRouted reads the topic with caughtup's Consumer, Policy Delayed, the
// router recording into the SDK as in production; the handler gets the
// pool it was routed to.
func runRouted(t testing.TB, e *env, router *consume.Router, topic string, n int, query bool) kafkasuite.Result {
	sd := newSide(n, query)
	c, err := caughtupkgo.NewConsumer(caughtupkgo.ConsumerConfig{
		ClientOpts: fetchOpts(t), GroupID: kafkasuite.NewGroup(t), Topic: topic,
		Router: router, Policy: consume.Delayed, MeterProvider: e.MP, Logger: kafkasuite.Logger(t),
	}, func(ctx context.Context, r *kgo.Record) error {
		p, err := consume.Pool(ctx, "main")
		if err != nil {
			return err
		}
		replica := ""
		if sd.query {
			d, _ := consume.DecisionFrom(ctx)
			if replica = d.Databases[0].Replica; replica == "" {
				return fmt.Errorf("record %s routed to the primary (%s): its replicas had caught up", r.Value, d.Reason)
			}
		}
		return sd.handle(ctx, r, p, replica)
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	res := sd.w.Wait(t, 5*time.Minute)
	cancel()
	require.NoError(t, <-done)
	return res
}

// runPlainPerPartition reads the topic as a plain franz-go application
// whose handler queries does: one group client, PollFetches, and each
// partition's records handed to a goroutine of its own (franz-go's
// goroutine-per-partition pattern), so that partitions query
// concurrently, one record at a time each, as caughtup's workers do;
// autocommit. The hand-off never blocks the poll loop (a queue per
// partition without bound, the topic being small), so that no partition's
// goroutine waits for records while another's queue is full. The handler
// reads the replicas without knowing whether they have caught up: with
// turn, each query on the next replica in turn; else each partition's
// goroutine on one replica, the k-th goroutine started on replica k mod
// their number, as the routed Consumer's workers do (consume.Tally).
func runPlainPerPartition(t testing.TB, rs *kafkasuite.BareReplicas, topic string, n int, turn bool) kafkasuite.Result {
	sd := newSide(n, true)
	cl, err := kgo.NewClient(append(fetchOpts(t), kgo.ConsumerGroup(kafkasuite.NewGroup(t)), kgo.ConsumeTopics(topic))...)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var workers sync.WaitGroup
	queues := map[int32]*plainQueue{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			for _, q := range queues {
				q.close()
			}
			workers.Wait()
		}()
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			if fs.IsClientClosed() || ctx.Err() != nil {
				return
			}
			fs.EachPartition(func(p kgo.FetchTopicPartition) {
				q, ok := queues[p.Partition]
				if !ok {
					q = newPlainQueue()
					home := len(queues)
					queues[p.Partition] = q
					workers.Go(func() {
						for {
							recs, ok := q.take()
							if !ok {
								return
							}
							for _, r := range recs {
								if ctx.Err() != nil {
									return
								}
								p, name := rs.At(home)
								if turn {
									p, name = rs.Next()
								}
								if err := sd.handle(ctx, r, p, name); err != nil && ctx.Err() == nil {
									t.Error(err)
								}
							}
						}
					})
				}
				q.push(p.Records)
			})
		}
	}()
	res := sd.w.Wait(t, 5*time.Minute)
	cancel()
	<-done
	cl.Close()
	return res
}

// plainQueue is a partition's records waiting for its goroutine, without
// bound.
type plainQueue struct {
	mu     sync.Mutex
	recs   []*kgo.Record
	closed bool
	wake   chan struct{}
}

func newPlainQueue() *plainQueue { return &plainQueue{wake: make(chan struct{}, 1)} }

func (q *plainQueue) push(rs []*kgo.Record) {
	q.mu.Lock()
	q.recs = append(q.recs, rs...)
	q.mu.Unlock()
	q.signal()
}

func (q *plainQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.signal()
}

func (q *plainQueue) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// take returns the records queued, waiting for some; false once closed.
func (q *plainQueue) take() ([]*kgo.Record, bool) {
	for {
		q.mu.Lock()
		recs, closed := q.recs, q.closed
		q.recs = nil
		q.mu.Unlock()
		if closed {
			return nil, false
		}
		if len(recs) > 0 {
			return recs, true
		}
		<-q.wake
	}
}

func benchEnv(t testing.TB, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	require.NoError(t, err, name)
	require.Positive(t, n, name)
	return n
}

// pairs are a benchmark's rounds: each side's result per round.
type pairs struct{ plain, routed []kafkasuite.Result }

// rounds runs plain and routed n times each, back to back, in
// alternating order. CAUGHTUP_KGO_BENCH_ONLY=plain or routed runs that
// side alone (the other's results are zero), for a CPU profile of one.
func rounds(n int, plain, routed func() kafkasuite.Result) pairs {
	var ps pairs
	only := os.Getenv("CAUGHTUP_KGO_BENCH_ONLY")
	for i := range n {
		var p, r kafkasuite.Result
		switch {
		case only == "plain":
			p = plain()
		case only == "routed":
			r = routed()
		case i%2 == 0:
			p = plain()
			r = routed()
		default:
			r = routed()
			p = plain()
		}
		ps.plain, ps.routed = append(ps.plain, p), append(ps.routed, r)
	}
	return ps
}

// of maps results to one figure each.
func of(rs []kafkasuite.Result, f func(kafkasuite.Result) float64) []float64 {
	out := make([]float64, len(rs))
	for i, r := range rs {
		out[i] = f(r)
	}
	return out
}

// ratios are each round's routed/plain of f, or plain/routed with inv
// (for costs, so that a figure below 1 means the routed side costs more).
func (ps pairs) ratios(f func(kafkasuite.Result) float64, inv bool) []float64 {
	out := make([]float64, len(ps.plain))
	for i := range out {
		p, r := f(ps.plain[i]), f(ps.routed[i])
		if inv {
			p, r = r, p
		}
		if p > 0 {
			out[i] = r / p
		}
	}
	return out
}

var (
	rate    = func(r kafkasuite.Result) float64 { return r.Rate }
	cpu     = func(r kafkasuite.Result) float64 { return float64(r.CPU.Nanoseconds()) }
	machine = func(r kafkasuite.Result) float64 { return float64(r.Machine.Nanoseconds()) }
	busy    = func(r kafkasuite.Result) float64 { return r.Busy }
	flight  = func(r kafkasuite.Result) float64 { return r.InFlight }
)

// report reports ps's medians and logs its table: rates, CPU per record
// (this process, the machine), how busy the machine's cores were, and
// for point queries how many ran at once and on which replicas.
func (ps pairs) report(b *testing.B, title string, query bool) {
	b.ReportMetric(latency.Percentile(of(ps.plain, rate), 0.5), "plain-rec/s")
	b.ReportMetric(latency.Percentile(of(ps.routed, rate), 0.5), "routed-rec/s")
	b.ReportMetric(latency.Percentile(ps.ratios(rate, false), 0.5), "routed/plain")
	b.ReportMetric(latency.Percentile(ps.ratios(cpu, true), 0.5), "cpu-plain/routed")
	var sb strings.Builder
	fmt.Fprintf(&sb, "%s, %d rounds (median (min–max)):\n", title, len(ps.plain))
	fmt.Fprintf(&sb, "\tratio routed/plain rec/s %s; CPU per record plain/routed: process %s, machine %s\n",
		kafkasuite.Spread3("%.3f", ps.ratios(rate, false)), kafkasuite.Spread3("%.3f", ps.ratios(cpu, true)),
		kafkasuite.Spread3("%.3f", ps.ratios(machine, true)))
	for _, s := range []struct {
		name string
		rs   []kafkasuite.Result
	}{{"plain", ps.plain}, {"routed", ps.routed}} {
		fmt.Fprintf(&sb, "\t%-6s rec/s %s, CPU ns/rec: process %s, machine %s; cores busy %s",
			s.name, kafkasuite.Spread3("%.0f", of(s.rs, rate)), kafkasuite.Spread3("%.0f", of(s.rs, cpu)),
			kafkasuite.Spread3("%.0f", of(s.rs, machine)), kafkasuite.Spread3("%.2f", of(s.rs, busy)))
		if query {
			fmt.Fprintf(&sb, "; queries at once %s; replicas %s", kafkasuite.Spread3("%.2f", of(s.rs, flight)), kafkasuite.Spread(s.rs))
		}
		sb.WriteString("\n")
	}
	b.Log(sb.String())
}

// BenchmarkThroughput reads pre-filled topics with a plain franz-go
// consumer (runPlain: one poll loop running a trivial handler) and with
// caughtup's Consumer running the same handler, and reports both rates,
// their ratio routed/plain and the ratio of CPU per record, plain/routed:
//
//   - token-per-record: every record carries a token of its own;
//   - runs-of-16: runs of 16 records in a partition share a token (one
//     transaction's events, an outbox batch).
func BenchmarkThroughput(b *testing.B) {
	e := setupDB(b, nil)
	n := benchEnv(b, "CAUGHTUP_KGO_BENCH_RECORDS", 2_000_000)
	nr := benchEnv(b, "CAUGHTUP_KGO_BENCH_ROUNDS", 5)
	ctx := stampedCtx(b, e)
	rs := kafkasuite.NewBareReplicas(b, e, e.Router)
	for _, run := range []int{1, 16} {
		name := "token-per-record"
		if run > 1 {
			name = fmt.Sprintf("runs-of-%d", run)
		}
		b.Run(name, func(b *testing.B) {
			topic := throughputTopic(b, ctx, n, run)
			var ps pairs
			for b.Loop() {
				ps = rounds(nr, func() kafkasuite.Result { return runPlain(b, rs, topic, n) },
					func() kafkasuite.Result { return runRouted(b, e, e.Router, topic, n, false) })
			}
			ps.report(b, fmt.Sprintf("%d records, %d partitions, trivial handler, %s", n, benchPartitions, name), false)
		})
	}
}

// BenchmarkThroughputQuery is BenchmarkThroughput with a handler that
// reads a row, as most handlers do, every record with a token of its own,
// against a plain consumer that runs each partition on a goroutine of its
// own (runPlainPerPartition), on a topic of
// CAUGHTUP_KGO_BENCH_QUERY_RECORDS records (default 100,000). The sides
// are alike but for the routing: 4 partitions each read one record at a
// time, the plain side's queues never starving a partition, through pools
// of the same size (the routed side's are the router's handler pools,
// built from the same configs as the plain side's):
//
//   - one-replica: a router over one replica, the plain side reading that
//     replica only;
//   - spread: the router over both replicas, each partition's worker
//     reading one of the caught-up ones (consume.Tally), the plain side's
//     goroutines one replica each in the same way;
//   - spread-turns: the same router against a plain side whose every
//     query reads the next replica in turn, as a plain application may
//     spread its reads: alternating costs each query more on this
//     machine, and this row shows by how much.
//
// The table shows how many queries each side ran at once and each
// replica's share.
func BenchmarkThroughputQuery(b *testing.B) {
	e := setupDB(b, nil)
	n := benchEnv(b, "CAUGHTUP_KGO_BENCH_QUERY_RECORDS", 100_000)
	nr := benchEnv(b, "CAUGHTUP_KGO_BENCH_ROUNDS", 5)
	topic := throughputTopic(b, stampedCtx(b, e), n, 1)
	one := oneReplicaRouter(b, e)
	for _, bc := range []struct {
		name   string
		router *consume.Router
		turn   bool
	}{{"one-replica", one, false}, {"spread", e.Router, false}, {"spread-turns", e.Router, true}} {
		b.Run(bc.name, func(b *testing.B) {
			rs := kafkasuite.NewBareReplicas(b, e, bc.router)
			var ps pairs
			for b.Loop() {
				ps = rounds(nr, func() kafkasuite.Result { return runPlainPerPartition(b, rs, topic, n, bc.turn) },
					func() kafkasuite.Result { return runRouted(b, e, bc.router, topic, n, true) })
			}
			ps.report(b, fmt.Sprintf("%d records, %d partitions, a point query per record, %s", n, benchPartitions, bc.name), true)
		})
	}
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

// BenchmarkRouteRecord is what the Consumer adds to each record besides
// the hand-off to its partition's worker: reading the token
// (TokenOf) and routing it (consume.Tally.Route), with the SDK metrics
// as in production. It is the floor under the throughput ratio: a plain
// franz-go loop with a trivial handler spends a few hundred nanoseconds
// on a record in all.
func BenchmarkRouteRecord(b *testing.B) {
	e := setupDB(b, nil)
	r := &kgo.Record{Value: []byte("x")}
	require.NoError(b, caughtupkgo.Stamp(stampedCtx(b, e), r))
	tally := e.Router.NewTally()
	route := func() error {
		tok, err := caughtupkgo.TokenOf(r)
		_, _, err = tally.Route(context.Background(), consume.Job{Token: tok, TokenErr: err, Policy: consume.Delayed})
		return err
	}
	require.Eventually(b, func() bool { return route() == nil }, 5*time.Second, 10*time.Millisecond)
	b.ReportAllocs()
	for b.Loop() {
		if err := route(); err != nil {
			b.Fatal(err)
		}
	}
}
