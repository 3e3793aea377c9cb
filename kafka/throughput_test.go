package kafka_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/caughtup/caughtup/consume"
	caughtupkafka "github.com/caughtup/caughtup/kafka"
)

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
// waiting, so the comparison measures the decorator's cost, not
// replication lag.
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
	r    *running
}

// startSide reads a whole topic of n messages, routed by router unless it
// is nil. The handler does nothing, or with query one point query on the
// pool it was given (the primary without a router).
func startSide(t testing.TB, e *env, topic string, n int, router *consume.Router, query bool) *side {
	sd := &side{done: make([]int64, n), all: make(chan struct{})}
	sd.r = startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, Router: router, Policy: consume.Delayed, CommitInterval: time.Second,
	}, func(ctx context.Context, msg kafkago.Message) error {
		pool := e.primary
		if router != nil {
			if pool = consume.DB(ctx, "main"); pool == nil {
				t.Errorf("routed handler without a pool")
				return nil
			}
		}
		if query {
			var one int
			if err := pool.QueryRow(ctx, `SELECT 1 FROM items WHERE id = (SELECT min(id) FROM items)`).Scan(&one); err != nil {
				return err
			}
		}
		if i := sd.n.Add(1); i <= int64(n) {
			sd.done[i-1] = time.Now().UnixNano()
			if i == int64(n) {
				close(sd.all)
			}
		}
		return nil
	})
	return sd
}

func (sd *side) wait(t testing.TB) {
	select {
	case <-sd.all:
	case <-time.After(2 * time.Minute):
		t.Fatalf("only %d of %d messages within 2 minutes", sd.n.Load(), len(sd.done))
	}
	require.NoError(t, sd.r.stop())
}

// rate is how many messages per second sd completed in [from, to].
func (sd *side) rate(from, to int64) float64 {
	n := 0
	for _, at := range sd.done {
		if at >= from && at <= to {
			n++
		}
	}
	return float64(n) / time.Duration(to-from).Seconds()
}

// rates are messages/s of a trivial handler: without the router, with the
// router recording into an SDK MeterProvider (as in production) and with
// a no-op one (the routing alone).
type rates struct{ plain, routed, routedNoMetrics float64 }

func (r rates) String() string {
	return fmt.Sprintf("plain %.0f msg/s, routed %.0f msg/s (ratio %.3f), routed without metrics %.0f msg/s (ratio %.3f)",
		r.plain, r.routed, r.routed/r.plain, r.routedNoMetrics, r.routedNoMetrics/r.plain)
}

// measure reads one topic of n messages again and again with fresh
// groups, one variant after the other in rotating order, and returns each
// variant's median rate over the rounds.
func measure(t testing.TB, e *env, n, rounds int, query bool) rates {
	quiet := e.quiet(t)
	topic := throughputTopic(t, stampedCtx(t, e), n)
	routers := [3]*consume.Router{nil, e.router, quiet}
	var got [3][]float64
	for round := range rounds {
		for k := range 3 {
			v := (round + k) % 3
			sd := startSide(t, e, topic, n, routers[v], query)
			sd.wait(t)
			got[v] = append(got[v], sd.rate(slices.Min(sd.done), slices.Max(sd.done)))
		}
	}
	return rates{median(got[0]), median(got[1]), median(got[2])}
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// TestThroughputWithAndWithoutRouter reports messages/s with and without
// the routing decorator in one run: of a trivial handler, and of one that
// runs a point query on the pool it was given. It asserts nothing about
// speed. On the in-process broker a trivial handler costs a few
// microseconds per message, so its ratio shows the router's per-message
// cost (BenchmarkMiddleware) almost undiluted; a handler that does any I/O
// dilutes it.
func TestThroughputWithAndWithoutRouter(t *testing.T) {
	e := setupDB(t, nil)
	n := 20000
	if raceEnabled {
		n = 5000
	}
	t.Logf("throughput, trivial handler, %d messages, 4 partitions, median of 3 rounds, %s: %s",
		n, raceNote, measure(t, e, n, 3, false))
	t.Logf("throughput, handler with one point query, %d messages, 4 partitions, median of 3 rounds, %s: %s",
		n/4, raceNote, measure(t, e, n/4, 3, true))
	t.Logf("router outcomes: %v", e.outcomes(t))
}

// BenchmarkThroughput is TestThroughputWithAndWithoutRouter with more
// messages: go test -run '^$' -bench Throughput -benchtime 1x ./kafka/
func BenchmarkThroughput(b *testing.B) {
	e := setupDB(b, nil)
	for _, query := range []bool{false, true} {
		name, n := "trivial", 200000
		if query {
			name, n = "point-query", 20000
		}
		b.Run(name, func(b *testing.B) {
			var r rates
			for b.Loop() {
				r = measure(b, e, n, 3, query)
			}
			b.ReportMetric(r.plain, "plain-msg/s")
			b.ReportMetric(r.routed, "routed-msg/s")
			b.ReportMetric(r.routed/r.plain, "ratio")
			b.ReportMetric(r.routedNoMetrics/r.plain, "ratio-no-metrics")
		})
	}
}

// BenchmarkMiddleware is the routing decorator alone around a trivial
// handler: what each message pays for Route (token decode, decision,
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
