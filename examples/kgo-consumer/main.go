// Command kgo-consumer is caughtup's franz-go adapter end to end: a
// producer inserts rows on the primary and, right after each commit,
// produces one keyed record stamped with the commit's position; a consumer
// group reads the topic, and each handler reads its row from the pool
// caughtup chose for the record. A record no replica has yet waits at the
// head of its partition with the partition's fetches paused, while the
// other partitions flow. It prints
//
//	messages=100 stale=0 lost=0 order_violations=0
//
// on stdout (a stale record read a replica that did not have its row yet;
// a lost record never ran; an order violation is a record that ran before
// an earlier record of its key), and on stderr where the records ran and
// what the consumer's caughtup.kafka.messages counter says once it has
// stopped.
//
// One command runs it on the demo's cluster (a primary with two streaming
// replicas and a Kafka broker, replay paused at random on the replicas):
//
//	go run ./cmd/caughtup-demo cluster -kafka -max-pause 1s -- go run ./examples/kgo-consumer
//
// On your own services:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	KAFKA_BROKERS=kafka1:9092,kafka2:9092 go run ./examples/kgo-consumer -messages 1000
//
// It creates the table caughtup_kgo_example_items (dropping an old one)
// and a topic named caughtup-kgo-example-<time> with its dead-letter
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
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/replay"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kgo-consumer:", err)
		os.Exit(1)
	}
}

const table = "caughtup_kgo_example_items"

type options struct {
	messages, keys, partitions int
	timeout                    time.Duration
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	var o options
	fs := flag.NewFlagSet("kgo-consumer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.messages, "messages", 100, "records to produce")
	fs.IntVar(&o.keys, "keys", 8, "distinct record keys")
	fs.IntVar(&o.partitions, "partitions", 4, "partitions of the topic")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long to wait for every record once produced; the rest are lost")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.messages < 1 || o.keys < 1 || o.partitions < 1 {
		return errors.New("-messages, -keys and -partitions must be positive")
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

	// One franz-go client produces; the consumer makes its own.
	client, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return err
	}
	defer client.Close()
	topic := fmt.Sprintf("caughtup-kgo-example-%d", time.Now().UnixNano())
	if err := createTopics(ctx, client, o.partitions, topic, topic+".dlt"); err != nil {
		return err
	}

	// Metrics: an application hands its MeterProvider (with an exporter)
	// to caughtup; here a manual reader collects them for the summary.
	metrics := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(metrics))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// The consumer side: one router per process, a consumer group whose
	// handler reads from the pool the router chose for each record.
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
	consumer, err := caughtupkgo.NewConsumer(caughtupkgo.ConsumerConfig{
		ClientOpts: []kgo.Opt{
			kgo.SeedBrokers(brokers...),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), // the records produced before the group joined
			kgo.FetchMaxWait(100 * time.Millisecond),          // a resumed partition waits at most this for a fetch
		},
		GroupID:        topic + "-group",
		Topic:          topic,
		Router:         router, // required: it gives each record its pool
		Policy:         consume.Delayed,
		Mode:           caughtupkgo.InPlace, // keep per-key order: pause the partition while its head waits
		CommitInterval: 200 * time.Millisecond,
		Logger:         logger,
		MeterProvider:  mp,
	}, st.handle)
	if err != nil {
		return err
	}
	consumerCtx, stopConsumer := context.WithCancel(ctx)
	defer stopConsumer()
	consumerDone := make(chan error, 1)
	go func() { consumerDone <- consumer.Run(consumerCtx) }()

	// The producer side: commit, then produce the record with the context
	// the commit returned; the Producer stamps the position on it.
	if err := produce(ctx, primary, caughtupkgo.NewProducer(client), topic, o); err != nil {
		return err
	}

	timer := time.NewTimer(o.timeout)
	defer timer.Stop()
	select {
	case <-st.all:
	case <-timer.C: // the summary counts the missing records as lost
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
	// What the consumer did with the records ("handled", "waited" per
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
	return "", fmt.Errorf("%s is not set: it names %s (`go run ./cmd/caughtup-demo cluster -kafka -- go run ./examples/kgo-consumer` starts the demo's cluster and sets it)", name, what)
}

// createTopics creates the topics and waits until every partition has a
// leader: a consumer group that joins before that is assigned none.
func createTopics(ctx context.Context, cl *kgo.Client, partitions int, topics ...string) error {
	req := kmsg.NewPtrCreateTopicsRequest()
	req.TimeoutMillis = 10000
	for _, t := range topics {
		rt := kmsg.NewCreateTopicsRequestTopic()
		rt.Topic, rt.NumPartitions, rt.ReplicationFactor = t, int32(partitions), -1 // -1: the brokers' default
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("create topics %v: %w", topics, err)
	}
	for _, rt := range resp.Topics {
		if err := kerr.ErrorForCode(rt.ErrorCode); err != nil {
			return fmt.Errorf("create topic %s: %w", rt.Topic, err)
		}
	}
	for {
		md := kmsg.NewPtrMetadataRequest()
		for _, t := range topics {
			mt := kmsg.NewMetadataRequestTopic()
			mt.Topic = kmsg.StringPtr(t)
			md.Topics = append(md.Topics, mt)
		}
		resp, err := md.RequestWith(ctx, cl)
		if err == nil && len(resp.Topics) == len(topics) && !slices.ContainsFunc(resp.Topics, func(t kmsg.MetadataResponseTopic) bool {
			return t.ErrorCode != 0 || len(t.Partitions) != partitions ||
				slices.ContainsFunc(t.Partitions, func(p kmsg.MetadataResponseTopicPartition) bool { return p.Leader < 0 })
		}) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("topics %v have partitions without a leader: %w", topics, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// produce inserts rows 1..messages one transaction each and produces each
// row's record right after its commit. One goroutine per key keeps each
// key's records in order (franz-go's default partitioner keeps a key on
// one partition).
func produce(ctx context.Context, primary *pgxpool.Pool, p *caughtupkgo.Producer, topic string, o options) error {
	errs := make(chan error, o.keys)
	var wg sync.WaitGroup
	for k := range o.keys {
		wg.Go(func() {
			key := fmt.Sprintf("user-%d", k)
			for id, seq := k+1, 0; id <= o.messages; id, seq = id+o.keys, seq+1 {
				rctx, err := enqueue.InTx(ctx, primary, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `INSERT INTO `+table+` (id, key, seq) VALUES ($1, $2, $3)`, id, key, seq)
					return err
				})
				if err == nil {
					err = p.ProduceSync(rctx, &kgo.Record{Topic: topic, Key: []byte(key), Value: []byte(fmt.Sprintf("%d,%d", id, seq))}).FirstErr()
				}
				if err != nil {
					errs <- fmt.Errorf("record %d: %w", id, err)
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
	next       map[string]int // per key: how many of its leading records ran
	where      map[string]int // per outcome (and replica): how many reads
	stale      int
	violations int
	all        chan struct{} // closed once every record ran
}

func newStats(want int) *stats {
	return &stats{want: want, ran: map[int64]bool{}, next: map[string]int{}, where: map[string]int{}, all: make(chan struct{})}
}

// handle is the record handler: it reads the record's row from the pool
// caughtup chose and records what it found.
func (s *stats) handle(ctx context.Context, r *kgo.Record) error {
	idText, seqText, _ := strings.Cut(string(r.Value), ",")
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
	stale := errors.Is(err, pgx.ErrNoRows) || (err == nil && key != string(r.Key))
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
	switch n := s.next[string(r.Key)]; {
	case seq == n:
		s.next[string(r.Key)] = n + 1
	case seq > n: // an earlier record of the key has not run yet
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
