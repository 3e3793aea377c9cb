// Command kafka-consumer is caughtup's Kafka adapter end to end: a producer
// inserts rows on the primary and, right after each commit, writes one
// keyed message stamped with the commit's position; a consumer group reads
// the topic, and each handler reads its row from the pool caughtup chose
// for the message while replay on the replicas pauses at random. It prints
//
//	messages=100 stale=0 lost=0 order_violations=0
//
// on stdout (a stale message read a replica that did not have its row yet;
// a lost message never ran; an order violation is a message that ran
// before an earlier message of its key), and on stderr where the messages
// ran and what the consumer's caughtup.kafka.messages counter says once
// it has stopped.
//
// Without configuration it starts its own primary with two streaming
// replicas (PostgreSQL 15 server binaries must be installed) and a
// single-node Apache Kafka 4.4 broker (Java 17; the jars come from Maven
// Central, see scripts/install-deps), and pauses replay at random. To use
// existing services instead:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	KAFKA_BROKERS=kafka1:9092,kafka2:9092 kafka-consumer -messages 1000
//
// It then creates the table caughtup_kafka_example_items (dropping an old
// one) and a topic named caughtup-kafka-example-<time> with its
// dead-letter topic, and pauses nothing.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/examplesvc"
)

func main() { examplesvc.Main("kafka-consumer", run) }

const table = "caughtup_kafka_example_items"

type options struct {
	messages   int
	keys       int
	partitions int
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var o options
	fs := examplesvc.NewFlags("kafka-consumer", stderr, time.Second)
	fs.IntVar(&o.messages, "messages", 100, "messages to produce")
	fs.IntVar(&o.keys, "keys", 8, "distinct message keys")
	fs.IntVar(&o.partitions, "partitions", 4, "partitions of the topic")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.messages < 1 || o.keys < 1 || o.partitions < 1 {
		return errors.New("-messages, -keys and -partitions must be positive")
	}

	svc, err := examplesvc.Postgres(ctx, stderr)
	if err != nil {
		return err
	}
	defer svc.Close()
	brokers, err := svc.Kafka(ctx, stderr)
	if err != nil {
		return err
	}
	if _, err := svc.Primary.Exec(ctx, `DROP TABLE IF EXISTS `+table+`; CREATE TABLE `+table+` (id bigint PRIMARY KEY, key text NOT NULL, seq int NOT NULL)`); err != nil {
		return err
	}
	topic := fmt.Sprintf("caughtup-kafka-example-%d", time.Now().UnixNano())
	for _, t := range []string{topic, topic + ".dlt"} {
		if err := svc.CreateTopic(ctx, t, o.partitions); err != nil {
			return err
		}
	}

	// Metrics: an application hands its MeterProvider (with an exporter)
	// to caughtup; here a manual reader collects them for the summary.
	metrics := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(metrics))
	defer func() { _ = mp.Shutdown(context.Background()) }()

	// The consumer side: one router per process, a consumer group whose
	// handler reads from the pool the router chose for each message.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: svc.Primary, Replicas: replay.Replicas(svc.Replicas...)}},
		Logger:        slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError})),
		MeterProvider: mp,
	})
	if err != nil {
		return err
	}
	defer router.Close()

	st := newStats(o.messages)
	consumer, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
		Brokers:        brokers,
		GroupID:        topic + "-group",
		Topic:          topic,
		Router:         router, // required: it gives each message its pool
		Policy:         consume.Delayed,
		Mode:           caughtupkafka.InPlace, // keep per-key order
		CommitInterval: 200 * time.Millisecond,
		MaxWait:        100 * time.Millisecond,
		Logger:         slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError})),
		MeterProvider:  mp,
	}, st.handle)
	if err != nil {
		return err
	}
	stopConsumer := examplesvc.Go(ctx, consumer.Run)
	defer stopConsumer()

	// Lag: random replay pauses on our own cluster while producing.
	stopPauses := svc.PauseReplay(ctx, fs.MaxPause, stderr)

	// The producer side: commit, then write the message with the context
	// the commit returned; the writer stamps the position on it.
	err = produce(ctx, svc.Primary, brokers, topic, o)
	stopPauses()
	if err != nil {
		return err
	}

	if err := examplesvc.Await(ctx, st.all, fs.Timeout); err != nil {
		return err
	}
	if err := stopConsumer(); err != nil {
		return err
	}

	stale, lost, violations := st.summary()
	fmt.Fprintf(stdout, "messages=%d stale=%d lost=%d order_violations=%d\n", o.messages, stale, lost, violations)
	fmt.Fprintf(stderr, "outcomes: %s\n", st.tally.Outcomes())
	// What the consumer did with the messages ("handled", "waited" per
	// wait in place, ...): its counter outlives its Run.
	results, err := examplesvc.CounterSums(ctx, metrics, "caughtup.kafka.messages", "caughtup.kafka.result")
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "consumer results: %s\n", results)
	if stale+lost+violations > 0 {
		return fmt.Errorf("%d stale, %d lost, %d out of order", stale, lost, violations)
	}
	return nil
}

// produce inserts rows 1..messages one transaction each and writes each
// row's message right after its commit. One goroutine per key keeps each
// key's messages in order.
func produce(ctx context.Context, primary *pgxpool.Pool, brokers []string, topic string, o options) error {
	tr := &kafkago.Transport{}
	kw := &kafkago.Writer{
		Addr:         kafkago.TCP(brokers...),
		Topic:        topic,
		Balancer:     &kafkago.Hash{},      // one key, one partition: per-key order
		RequiredAcks: kafkago.RequireAll,   // an acknowledged message survives a leader change
		BatchTimeout: 5 * time.Millisecond, // synchronous writes; the default waits 1s
		Transport:    tr,
	}
	defer func() {
		_ = kw.Close()
		tr.CloseIdleConnections()
	}()
	w := caughtupkafka.NewWriter(kw)

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
					err = w.WriteMessages(mctx, kafkago.Message{Key: []byte(key), Value: []byte(fmt.Sprintf("%d,%d", id, seq))})
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
	return errors.Join(collect(errs)...)
}

func collect(errs <-chan error) []error {
	var out []error
	for err := range errs {
		out = append(out, err)
	}
	return out
}

// stats checks what the handlers saw.
type stats struct {
	tally examplesvc.Tally // stale reads, where they went, per-key order
	mu    sync.Mutex
	want  int
	ran   map[int64]bool
	all   chan struct{} // closed once every message ran
}

func newStats(want int) *stats {
	return &stats{want: want, ran: map[int64]bool{}, all: make(chan struct{})}
}

// handle is the message handler: it reads the message's row from the pool
// caughtup chose and records what it found.
func (s *stats) handle(ctx context.Context, msg kafkago.Message) error {
	idText, seqText, _ := strings.Cut(string(msg.Value), ",")
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
	stale := errors.Is(err, pgx.ErrNoRows) || (err == nil && key != string(msg.Key))
	if err != nil && !stale {
		return err // a real error: the consumer retries
	}
	s.tally.Ran(ctx, "main", string(msg.Key), seq, stale)

	s.mu.Lock()
	defer s.mu.Unlock()
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
	return s.tally.Stale(), s.want - len(s.ran), s.tally.Violations()
}
