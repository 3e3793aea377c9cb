// Command kafka-consumer is caughtup's Kafka adapters end to end, on
// kafka-go (caughtupkafka, the default) or franz-go (caughtupkgo, with
// -client franz-go): a producer inserts rows on the primary and, right
// after each commit, writes one keyed message stamped with the commit's
// position; a consumer group reads the topic, and each handler reads its
// row from the pool caughtup chose for the message. A message no replica
// has yet waits at the head of its partition (kafka-go: its partition's
// reader is not read; franz-go: the partition's fetches are paused),
// while the other partitions flow. It prints
//
//	messages=100 stale=0 lost=0 order_violations=0
//
// on stdout (a stale message read a replica that did not have its row yet;
// a lost message never ran; an order violation is a message that ran
// before an earlier message of its key), and on stderr where the messages
// ran and what the consumer's caughtup.kafka.messages counter says once
// it has stopped.
//
// The two clients differ only in kafkago.go and franzgo.go: how each
// creates topics, produces through its stamper and configures its
// consumer.
//
// One command runs it on the demo's cluster (a primary with two streaming
// replicas and a Kafka broker, replay paused at random on the replicas):
//
//	make example EXAMPLE=kafka-consumer EXAMPLE_ARGS='-client franz-go'
//
// that is,
//
//	go run ./cmd/caughtup-demo cluster -kafka -max-pause 1s -- go run ./examples/kafka-consumer -client franz-go
//
// On your own services:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	KAFKA_BROKERS=kafka1:9092,kafka2:9092 go run ./examples/kafka-consumer -messages 1000
//
// It creates the table caughtup_kafka_example_items (dropping an old one)
// and a topic named caughtup-kafka-example-<time> with its dead-letter
// topic.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kafka-consumer:", err)
		os.Exit(1)
	}
}

const table = "caughtup_kafka_example_items"

type options struct {
	client                     string
	messages, keys, partitions int
	timeout                    time.Duration
}

// A client is one Kafka client library with its caughtup adapter:
// kafka-go (kafkago.go) or franz-go (franzgo.go).
type client interface {
	// createTopics creates the topics and waits until every partition
	// has a leader: a consumer group that joins before that is assigned
	// none.
	createTopics(ctx context.Context, partitions int, topics ...string) error
	// consumer returns the Run of a consumer group on topic whose handler
	// is st's.
	consumer(topic string, router *consume.Router, st *stats, logger *slog.Logger, mp metric.MeterProvider) (func(context.Context) error, error)
	// produce writes a message through the adapter's stamper, which puts
	// the position ctx carries on it, and waits for the broker.
	produce(ctx context.Context, topic, key string, value []byte) error
	close()
}

// clients are the -client values.
var clients = map[string]func(brokers []string) (client, error){
	"kafka-go": newKafkaGo,
	"franz-go": newFranzGo,
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	var o options
	fs := flag.NewFlagSet("kafka-consumer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.client, "client", "kafka-go", "the Kafka client: kafka-go (caughtupkafka) or franz-go (caughtupkgo)")
	fs.IntVar(&o.messages, "messages", 100, "messages to produce")
	fs.IntVar(&o.keys, "keys", 8, "distinct message keys")
	fs.IntVar(&o.partitions, "partitions", 4, "partitions of the topic")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long to wait for every message once produced; the rest are lost")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.messages < 1 || o.keys < 1 || o.partitions < 1 {
		return errors.New("-messages, -keys and -partitions must be positive")
	}
	newClient, ok := clients[o.client]
	if !ok {
		return fmt.Errorf("-client %q: use kafka-go or franz-go", o.client)
	}
	primaryURL, err := need(getenv, "CAUGHTUP_PRIMARY_URL", "the primary's URL")
	if err != nil {
		return err
	}
	replicaURLs, err := need(getenv, "CAUGHTUP_REPLICA_URLS", "its streaming replicas' URLs, comma-separated")
	if err != nil {
		return err
	}
	brokerList, err := need(getenv, "KAFKA_BROKERS", "the Kafka brokers' host:port, comma-separated")
	if err != nil {
		return err
	}
	brokers := strings.Split(brokerList, ",")

	primary, err := pgxpool.New(ctx, primaryURL)
	if err != nil {
		return fmt.Errorf("CAUGHTUP_PRIMARY_URL: %w", err)
	}
	defer primary.Close()
	var replicas []*pgxpool.Pool
	for _, u := range strings.Split(replicaURLs, ",") {
		p, err := pgxpool.New(ctx, strings.TrimSpace(u))
		if err != nil {
			return fmt.Errorf("CAUGHTUP_REPLICA_URLS: %w", err)
		}
		defer p.Close()
		replicas = append(replicas, p)
	}
	if _, err := primary.Exec(ctx, `DROP TABLE IF EXISTS `+table+`; CREATE TABLE `+table+` (id bigint PRIMARY KEY, key text NOT NULL, seq int NOT NULL)`); err != nil {
		return err
	}
	kc, err := newClient(brokers)
	if err != nil {
		return err
	}
	defer kc.close()
	topic := fmt.Sprintf("caughtup-kafka-example-%d", time.Now().UnixNano())
	if err := kc.createTopics(ctx, o.partitions, topic, topic+".dlt"); err != nil {
		return err
	}

	// Metrics: an application hands its MeterProvider (with an exporter)
	// to caughtup; here a manual reader collects them for the summary.
	metrics := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(metrics))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// The consumer side: one router per process, a consumer group whose
	// handler reads from the pool the router chose for each message.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replicas...)}},
		Logger:        logger,
		MeterProvider: mp,
	})
	if err != nil {
		return err
	}
	defer router.Close()

	st := newStats(o.messages)
	runConsumer, err := kc.consumer(topic, router, st, logger, mp)
	if err != nil {
		return err
	}
	consumerCtx, stopConsumer := context.WithCancel(ctx)
	defer stopConsumer()
	consumerDone := make(chan error, 1)
	go func() { consumerDone <- runConsumer(consumerCtx) }()

	// The producer side: commit, then write the message with the context
	// the commit returned; the adapter's stamper puts the position on it.
	if err := produce(ctx, primary, kc, topic, o); err != nil {
		return err
	}

	timer := time.NewTimer(o.timeout)
	defer timer.Stop()
	select {
	case <-st.all:
	case <-timer.C: // the summary counts the missing messages as lost
	case err := <-consumerDone:
		return fmt.Errorf("consumer stopped: %w", err)
	case <-ctx.Done():
		return ctx.Err()
	}
	stopConsumer()
	if err := <-consumerDone; err != nil && !errors.Is(err, context.Canceled) {
		return err
	}

	stale, lost, violations := st.summary()
	fmt.Fprintf(stdout, "messages=%d stale=%d lost=%d order_violations=%d\n", o.messages, stale, lost, violations)
	fmt.Fprintf(stderr, "outcomes: %s\n", st.outcomes())
	// What the consumer did with the messages ("handled", "waited" per
	// wait in place, ...): its counter outlives its Run.
	results, err := counterSums(ctx, metrics, "caughtup.kafka.messages", "caughtup.kafka.result")
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "consumer results: %s\n", results)
	if stale+lost+violations > 0 {
		return fmt.Errorf("%d stale, %d lost, %d out of order", stale, lost, violations)
	}
	return nil
}

// need returns the environment variable name, or an error that names it.
func need(getenv func(string) string, name, what string) (string, error) {
	if v := strings.TrimSpace(getenv(name)); v != "" {
		return v, nil
	}
	return "", fmt.Errorf("%s is not set: it names %s (`make example EXAMPLE=kafka-consumer` starts the demo's cluster and sets it)", name, what)
}

// produce inserts rows 1..messages one transaction each and writes each
// row's message right after its commit. One goroutine per key keeps each
// key's messages in order.
func produce(ctx context.Context, primary *pgxpool.Pool, kc client, topic string, o options) error {
	errs := make(chan error, o.keys)
	var wg sync.WaitGroup
	for k := range o.keys {
		wg.Go(func() {
			key := fmt.Sprintf("user-%d", k)
			for id, seq := k+1, 0; id <= o.messages; id, seq = id+o.keys, seq+1 {
				mctx, err := enqueue.InTx(ctx, primary, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `INSERT INTO `+table+` (id, key, seq) VALUES ($1, $2, $3)`, id, key, seq)
					return err
				})
				if err == nil {
					err = kc.produce(mctx, topic, key, []byte(fmt.Sprintf("%d,%d", id, seq)))
				}
				if err != nil {
					errs <- fmt.Errorf("message %d: %w", id, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

// stats checks what the handlers saw.
type stats struct {
	mu         sync.Mutex
	want       int
	ran        map[int64]bool
	next       map[string]int // per key: how many of its leading messages ran
	where      map[string]int // per outcome (and replica): how many reads
	stale      int
	violations int
	all        chan struct{} // closed once every message ran
}

func newStats(want int) *stats {
	return &stats{want: want, ran: map[int64]bool{}, next: map[string]int{}, where: map[string]int{}, all: make(chan struct{})}
}

// handle is the message handler, the same for both clients: it reads the
// row of the message (key, value) from the pool caughtup chose and records
// what it found.
func (s *stats) handle(ctx context.Context, msgKey, value []byte) error {
	idText, seqText, _ := strings.Cut(string(value), ",")
	id, err := strconv.ParseInt(idText, 10, 64)
	if err != nil {
		return err
	}
	seq, err := strconv.Atoi(seqText)
	if err != nil {
		return err
	}
	var key string
	err = consume.DB(ctx, "main").QueryRow(ctx, `SELECT key FROM `+table+` WHERE id = $1`, id).Scan(&key)
	stale := errors.Is(err, pgx.ErrNoRows) || (err == nil && key != string(msgKey))
	if err != nil && !stale {
		return err // a real error: the consumer retries
	}

	// Where the read went: the outcome, and the replica chosen if any.
	d, _ := consume.DecisionFrom(ctx)
	where := d.Outcome.String()
	if dd, ok := d.Database("main"); ok && dd.Replica != "" {
		where += "@" + dd.Replica
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.where[where]++
	if stale {
		s.stale++
	}
	switch n := s.next[string(msgKey)]; {
	case seq == n:
		s.next[string(msgKey)] = n + 1
	case seq > n: // an earlier message of the key has not run yet
		s.violations++
	} // seq < n: a redelivery, no violation
	if !s.ran[id] {
		s.ran[id] = true
		if len(s.ran) == s.want {
			close(s.all)
		}
	}
	return nil
}

func (s *stats) summary() (stale, lost, violations int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stale, s.want - len(s.ran), s.violations
}

func (s *stats) outcomes() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return counts(s.where)
}

// counterSums collects r and adds up the data points of the int64 counter
// name by the value of its attribute attr.
func counterSums(ctx context.Context, r *sdkmetric.ManualReader, name, attr string) (string, error) {
	var rm metricdata.ResourceMetrics
	if err := r.Collect(ctx, &rm); err != nil {
		return "", err
	}
	by := map[string]int{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == name {
				for _, dp := range sum.DataPoints {
					v, _ := dp.Attributes.Value(attribute.Key(attr))
					by[v.AsString()] += int(dp.Value)
				}
			}
		}
	}
	return counts(by), nil
}

// counts formats "key=n" pairs in key order.
func counts(m map[string]int) string {
	parts := make([]string, 0, len(m))
	for k, n := range m {
		parts = append(parts, fmt.Sprintf("%s=%d", k, n))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}
