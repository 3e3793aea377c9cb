package caughtupkgo_test

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
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// Throughput is measured here, never asserted in tests:
//
//	go test -run '^$' -bench Throughput ./kafka/caughtupkgo/
//
// on the test binary's real Kafka 4.4 broker (or KAFKA_BROKERS).
// CAUGHTUP_KGO_BENCH_RECORDS sets the size of the topic (default
// 1,000,000 records: with fewer, the plain consumer's window is spent in
// records it fetched before the window began), CAUGHTUP_KGO_BENCH_ROUNDS how many runs of each side
// (default 3; the ratio is the median of the rounds' ratios).

// benchPartitions is the partition count of the throughput topic.
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
// records, each stamped as its producer would after its own commit: a
// token of its own (a position at or below the one ctx carries, so that
// the replicas have it), so that every record's token is decoded. Each
// value is the record's index.
func throughputTopic(t testing.TB, ctx context.Context, n int) string {
	topic := kafkasuite.NewTopics(t, benchPartitions, "")[0]
	cl := newClient(t, kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.RoundRobinPartitioner()))
	base, ok := enqueue.TokenFrom(ctx)
	require.True(t, ok)
	e := base.Entries[0]
	batch := make([]*kgo.Record, 0, 10000)
	for i := range n {
		r := &kgo.Record{Key: []byte(strconv.Itoa(i % 64)), Value: []byte(strconv.Itoa(i))}
		tok := position.New(e.Database, e.Epoch, e.LSN-position.LSN(i%4096), position.SourcePrimary, base.CapturedAt)
		require.NoError(t, caughtupkgo.Stamp(enqueue.WithToken(ctx, tok), r))
		batch = append(batch, r)
		if len(batch) == cap(batch) || i == n-1 {
			require.NoError(t, cl.ProduceSync(ctx, batch...).FirstErr())
			batch = batch[:0]
		}
	}
	return topic
}

// side is one consumer of a throughput run: a fresh group over the topic.
// The run ends when every record ran at least once, and is timed over
// its middle: from the first run of the 10%-th distinct record to that of
// the 90%-th, so that neither joining the group and filling the fetch
// pipeline nor a tail of partitions finishing one after another is
// measured, only the steady rate.
type side struct {
	// query: the handler reads a row (a point query on the pool it got),
	// as most real handlers do, rather than nothing.
	query    bool
	seen     []atomic.Bool
	distinct atomic.Int64
	from, to int64
	marks    [2]time.Time
	marked   sync.WaitGroup
	all      chan struct{}
}

func newSide(n int, query bool) *side {
	sd := &side{query: query, seen: make([]atomic.Bool, n), all: make(chan struct{}), from: int64(n) / 10, to: int64(n) * 9 / 10}
	sd.marked.Add(2)
	return sd
}

// handle gets its pool, reads a row there if sd.query, and notes the
// record.
func (sd *side) handle(ctx context.Context, r *kgo.Record, pool func(context.Context) (*pgxpool.Pool, error)) error {
	p, err := pool(ctx)
	if err != nil {
		return err
	}
	i, err := strconv.Atoi(string(r.Value))
	if err != nil || i < 0 || i >= len(sd.seen) {
		return fmt.Errorf("not a throughput record: %q", r.Value)
	}
	if sd.query {
		var n int
		if err := p.QueryRow(ctx, `SELECT count(*) FROM items WHERE id = $1`, i).Scan(&n); err != nil {
			return err
		}
	}
	if !sd.seen[i].Swap(true) {
		switch sd.distinct.Add(1) {
		case sd.from:
			sd.marks[0] = time.Now()
			sd.marked.Done()
		case sd.to:
			sd.marks[1] = time.Now()
			sd.marked.Done()
		}
		if sd.distinct.Load() == int64(len(sd.seen)) {
			close(sd.all)
		}
	}
	return nil
}

// wait waits for every record and returns records/s over the window.
func (sd *side) wait(t testing.TB) float64 {
	select {
	case <-sd.all:
	case <-time.After(5 * time.Minute):
		t.Fatalf("only %d of %d records within 5 minutes", sd.distinct.Load(), len(sd.seen))
	}
	sd.marked.Wait()
	return float64(sd.to-sd.from) / sd.marks[1].Sub(sd.marks[0]).Seconds()
}

// fetchOpts are both sides' client settings.
func fetchOpts(t testing.TB, topic string) []kgo.Opt {
	return []kgo.Opt{kgo.SeedBrokers(kafkasuite.Brokers(t)...), kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}
}

// runPlain reads the topic as a plain franz-go application does: one
// group client, a loop of PollFetches and the handler on each record,
// autocommit. The handler reads the replicas in turn, without knowing
// whether they have caught up.
func runPlain(t testing.TB, e *env, topic string, n int) float64 {
	sd := newSide(n, false)
	cl, err := kgo.NewClient(append(fetchOpts(t, topic), kgo.ConsumerGroup(kafkasuite.NewGroup(t)), kgo.ConsumeTopics(topic))...)
	require.NoError(t, err)
	var turn atomic.Uint32
	pool := func(context.Context) (*pgxpool.Pool, error) {
		return e.Replicas[int(turn.Add(1))%len(e.Replicas)], nil
	}
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
				if err := sd.handle(ctx, r, pool); err != nil {
					t.Error(err)
				}
			})
		}
	}()
	rate := sd.wait(t)
	cancel()
	<-done
	cl.Close()
	return rate
}

// runRouted reads the topic with caughtup's Consumer, Policy Delayed, the
// router recording into the SDK as in production; the handler gets the
// pool it was routed to.
func runRouted(t testing.TB, e *env, topic string, n int, query bool) float64 {
	sd := newSide(n, query)
	c, err := caughtupkgo.NewConsumer(caughtupkgo.ConsumerConfig{
		ClientOpts: fetchOpts(t, topic), GroupID: kafkasuite.NewGroup(t), Topic: topic,
		Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP, Logger: kafkasuite.Logger(t),
	}, func(ctx context.Context, r *kgo.Record) error {
		return sd.handle(ctx, r, func(ctx context.Context) (*pgxpool.Pool, error) { return consume.Pool(ctx, "main") })
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	rate := sd.wait(t)
	cancel()
	require.NoError(t, <-done)
	return rate
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

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// BenchmarkThroughput reads one pre-filled topic with a plain franz-go
// consumer and with caughtup's Consumer, a trivial handler each, and
// reports both rates and their ratio, routed/plain: the median of the
// rounds' ratios. Each round runs both sides back to back, in alternating
// order, because rates on 2 shared cores drift over tens of seconds.
func BenchmarkThroughput(b *testing.B) {
	e := setupDB(b, nil)
	n := benchEnv(b, "CAUGHTUP_KGO_BENCH_RECORDS", 1_000_000)
	rounds := benchEnv(b, "CAUGHTUP_KGO_BENCH_ROUNDS", 3)
	topic := throughputTopic(b, stampedCtx(b, e), n)
	var plain, routed, ratios []float64
	for b.Loop() {
		plain, routed, ratios = nil, nil, nil
		for i := range rounds {
			var p, r float64
			if i%2 == 0 {
				p, r = runPlain(b, e, topic, n), runRouted(b, e, topic, n, false)
			} else {
				r, p = runRouted(b, e, topic, n, false), runPlain(b, e, topic, n)
			}
			plain, routed, ratios = append(plain, p), append(routed, r), append(ratios, r/p)
		}
	}
	b.ReportMetric(median(plain), "plain-rec/s")
	b.ReportMetric(median(routed), "routed-rec/s")
	b.ReportMetric(median(ratios), "routed/plain")
	b.Logf("%d records, %d partitions, %d rounds: plain %.0f rec/s, routed %.0f rec/s, ratio routed/plain %.3f (rounds %.3f)",
		n, benchPartitions, rounds, median(plain), median(routed), median(ratios), ratios)
}

// runPlainPerPartition reads the topic as a plain franz-go application
// whose handler queries does: one group client, PollFetches, and each
// partition's records handed to a goroutine of its own (franz-go's
// goroutine-per-partition pattern), so that partitions query
// concurrently, as caughtup's workers do; autocommit. The handler reads a
// row from the replicas in turn, without knowing whether they have caught
// up.
func runPlainPerPartition(t testing.TB, e *env, topic string, n int) float64 {
	sd := newSide(n, true)
	cl, err := kgo.NewClient(append(fetchOpts(t, topic), kgo.ConsumerGroup(kafkasuite.NewGroup(t)), kgo.ConsumeTopics(topic))...)
	require.NoError(t, err)
	var turn atomic.Uint32
	pool := func(context.Context) (*pgxpool.Pool, error) {
		return e.Replicas[int(turn.Add(1))%len(e.Replicas)], nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	var workers sync.WaitGroup
	queues := map[int32]chan []*kgo.Record{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			for _, q := range queues {
				close(q)
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
					q = make(chan []*kgo.Record, 4)
					queues[p.Partition] = q
					workers.Go(func() {
						for rs := range q {
							for _, r := range rs {
								if ctx.Err() != nil {
									return
								}
								if err := sd.handle(ctx, r, pool); err != nil && ctx.Err() == nil {
									t.Error(err)
								}
							}
						}
					})
				}
				select {
				case q <- p.Records:
				case <-ctx.Done():
				}
			})
		}
	}()
	rate := sd.wait(t)
	cancel()
	<-done
	cl.Close()
	return rate
}

// BenchmarkThroughputQuery is BenchmarkThroughput with a handler that
// reads a row, as most handlers do, against a plain consumer that runs
// each partition on a goroutine of its own (runPlainPerPartition), on a
// topic of CAUGHTUP_KGO_BENCH_QUERY_RECORDS records (default 40,000).
func BenchmarkThroughputQuery(b *testing.B) {
	e := setupDB(b, nil)
	n := benchEnv(b, "CAUGHTUP_KGO_BENCH_QUERY_RECORDS", 40_000)
	rounds := benchEnv(b, "CAUGHTUP_KGO_BENCH_ROUNDS", 3)
	topic := throughputTopic(b, stampedCtx(b, e), n)
	var plain, routed, ratios []float64
	for b.Loop() {
		plain, routed, ratios = nil, nil, nil
		for i := range rounds {
			var p, r float64
			if i%2 == 0 {
				p, r = runPlainPerPartition(b, e, topic, n), runRouted(b, e, topic, n, true)
			} else {
				r, p = runRouted(b, e, topic, n, true), runPlainPerPartition(b, e, topic, n)
			}
			plain, routed, ratios = append(plain, p), append(routed, r), append(ratios, r/p)
		}
	}
	b.ReportMetric(median(plain), "plain-rec/s")
	b.ReportMetric(median(routed), "routed-rec/s")
	b.ReportMetric(median(ratios), "routed/plain")
	b.Logf("%d records, %d partitions, %d rounds, a point query per record: plain %.0f rec/s, routed %.0f rec/s, ratio routed/plain %.3f (rounds %.3f)",
		n, benchPartitions, rounds, median(plain), median(routed), median(ratios), ratios)
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
