// Command debezium-consumer is caughtup's Kafka adapter on a Debezium
// topic: transactions on the primary bump per-key counters, the Debezium
// PostgreSQL connector (Kafka Connect, pgoutput) streams each change to
// Kafka, and a consumer group reads the topic with TokenSource
// TokenDebezium. Each handler reads the changed row from the pool caughtup
// chose for the event, while replay on the replicas pauses at random. It
// prints
//
//	changes=241 stale=0 lost=0 order_violations=0
//
// on stdout (a stale change read a replica that did not show it yet; a
// lost change never ran; an order violation is a change that ran before an
// earlier change of its key), and on stderr where the changes ran and
// what the commit-safe checks found.
//
// Debezium's source.lsn is the change's position, before its commit, so
// it is no token by itself: the consumer routes an event to a replica only
// once the replica has replayed past it and reports its transaction
// committed (package cdc); otherwise the event waits, is deferred or reads
// the primary, as a stamped message would.
//
// Without configuration it starts a primary with two streaming replicas
// (PostgreSQL 15), a single-node Apache Kafka 4.4 broker and a Kafka
// Connect 4.3 worker with Debezium 3.6.1 (Java 17; the jars come from
// Maven Central, see scripts/install-deps), and pauses replay at random.
// To use your own PostgreSQL and Kafka (the worker still runs here):
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	KAFKA_BROKERS=kafka1:9092 debezium-consumer -transactions 1000
//
// The primary needs wal_level = logical and a user with REPLICATION that
// may create a publication; the program creates the table
// caughtup_cdc_example_counters (dropping an old one) and pauses nothing.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/examplesvc"
)

func main() { examplesvc.Main("debezium-consumer", run) }

const table = "caughtup_cdc_example_counters"

type options struct {
	transactions int
	keys         int
	partitions   int
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var o options
	fs := examplesvc.NewFlags("debezium-consumer", stderr, time.Second)
	fs.IntVar(&o.transactions, "transactions", 200, "transactions to run, each bumping one or two counters")
	fs.IntVar(&o.keys, "keys", 8, "distinct counters (rows, and so message keys)")
	fs.IntVar(&o.partitions, "partitions", 4, "partitions of the change topic")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.transactions < 1 || o.keys < 1 || o.partitions < 1 {
		return errors.New("-transactions, -keys and -partitions must be positive")
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
	if _, err := svc.Primary.Exec(ctx, `DROP TABLE IF EXISTS `+table+`; CREATE TABLE `+table+` (key text PRIMARY KEY, seq int NOT NULL)`); err != nil {
		return err
	}
	// The connector writes changes of public.<table> to
	// <prefix>.public.<table>; created first with the partitions we want
	// (Connect would create it with the broker's default).
	prefix := fmt.Sprintf("caughtup_cdc_example_%d", time.Now().UnixNano())
	topic := prefix + ".public." + table
	if err := svc.CreateTopic(ctx, topic, o.partitions); err != nil {
		return err
	}
	if err := svc.Debezium(ctx, stderr, brokers, prefix, "public."+table); err != nil {
		return err
	}

	metrics := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(metrics))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// The consumer side: one router per process; the consumer reads the
	// Debezium topic and routes each change by its source position.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: svc.Primary, Replicas: replay.Replicas(svc.Replicas...)}},
		Logger:        logger,
		MeterProvider: mp,
	})
	if err != nil {
		return err
	}
	defer router.Close()
	st := newStats()
	consumer, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
		Brokers:       brokers,
		GroupID:       prefix + "-group",
		Topic:         topic,
		TokenFormat:   caughtupkafka.TokenDebezium,                    // the token is the envelope's source position
		Debezium:      caughtupkafka.DebeziumConfig{Database: "main"}, // the router's database the connector captures
		Router:        router,
		Policy:        consume.Delayed,
		Mode:          caughtupkafka.InPlace, // keep per-key order
		MaxWait:       100 * time.Millisecond,
		Logger:        logger,
		MeterProvider: mp,
	}, st.handle)
	if err != nil {
		return err
	}
	stopConsumer := examplesvc.Go(ctx, consumer.Run)
	defer stopConsumer()

	// Lag: random replay pauses on our own cluster until every change ran.
	stopPauses := svc.PauseReplay(ctx, fs.MaxPause, stderr)
	defer stopPauses()

	// The producer side: plain transactions; Debezium does the rest.
	final, err := produce(ctx, svc, o)
	if err != nil {
		return err
	}
	st.expect(final)
	if err := examplesvc.Await(ctx, st.all, fs.Timeout); err != nil {
		return err
	}
	stopPauses()
	if err := stopConsumer(); err != nil {
		return err
	}

	changes, stale, lost, violations := st.summary()
	fmt.Fprintf(stdout, "changes=%d stale=%d lost=%d order_violations=%d\n", changes, stale, lost, violations)
	fmt.Fprintf(stderr, "outcomes: %s\n", st.tally.Outcomes())
	checks, err := examplesvc.CounterSums(ctx, metrics, "caughtup.cdc.checks", "caughtup.reason")
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "commit-safe checks on replicas, by reason: %s\n", checks)
	if stale+lost+violations > 0 {
		return fmt.Errorf("%d stale, %d lost, %d out of order", stale, lost, violations)
	}
	return nil
}

// produce inserts the counters, then runs the transactions, each adding 1
// to one counter or, one in five, to two at once, and returns every
// counter's final value.
func produce(ctx context.Context, svc *examplesvc.Services, o options) (map[string]int, error) {
	for k := range o.keys {
		if _, err := svc.Primary.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, 0)`, fmt.Sprintf("user-%d", k)); err != nil {
			return nil, err
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range o.transactions {
		a, b := rng.IntN(o.keys), rng.IntN(o.keys)
		keys := []int{min(a, b)}
		if i%5 == 0 && a != b {
			keys = append(keys, max(a, b)) // in key order: no deadlock with other writers
		}
		err := pgx.BeginFunc(ctx, svc.Primary, func(tx pgx.Tx) error {
			for _, k := range keys {
				if _, err := tx.Exec(ctx, `UPDATE `+table+` SET seq = seq + 1 WHERE key = $1`, fmt.Sprintf("user-%d", k)); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	final := map[string]int{}
	rows, err := svc.Primary.Query(ctx, `SELECT key, seq FROM `+table)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var k string
		var s int
		if err := rows.Scan(&k, &s); err != nil {
			return nil, err
		}
		final[k] = s
	}
	return final, rows.Err()
}

// stats checks what the handlers saw: per key, the changes 0 (the insert)
// to the final value.
type stats struct {
	tally  examplesvc.Tally // stale reads, where they went, per-key order
	mu     sync.Mutex
	final  map[string]int // per key: the last change; nil until known
	all    chan struct{}  // closed once every key's last change ran
	closed bool
}

func newStats() *stats {
	return &stats{all: make(chan struct{})}
}

// handle is the message handler: it reads the changed row from the pool
// caughtup chose and records what it found.
func (s *stats) handle(ctx context.Context, msg kafkago.Message) error {
	var ev struct {
		Op    string `json:"op"`
		After *struct {
			Key string `json:"key"`
			Seq int    `json:"seq"`
		} `json:"after"`
	}
	if err := json.Unmarshal(msg.Value, &ev); err != nil || ev.After == nil {
		return nil // a tombstone or a deletion: nothing to read here
	}
	var seq int
	err := consume.DB(ctx, "main").QueryRow(ctx, `SELECT seq FROM `+table+` WHERE key = $1`, ev.After.Key).Scan(&seq)
	stale := errors.Is(err, pgx.ErrNoRows) || (err == nil && seq < ev.After.Seq)
	if err != nil && !stale {
		return err // a real error: the consumer retries
	}
	s.tally.Ran(ctx, "main", ev.After.Key, ev.After.Seq, stale)

	s.mu.Lock()
	defer s.mu.Unlock()
	s.check()
	return nil
}

// expect records the final values, once the producer is done.
func (s *stats) expect(final map[string]int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.final = final
	s.check()
}

// check closes all once every key's last change ran. Called locked.
func (s *stats) check() {
	if s.final == nil || s.closed {
		return
	}
	for k, last := range s.final {
		if s.tally.Next(k) <= last {
			return
		}
	}
	s.closed = true
	close(s.all)
}

func (s *stats) summary() (changes, stale, lost, violations int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, last := range s.final {
		changes += last + 1
		if n := s.tally.Next(k); n <= last {
			lost += last + 1 - n
		}
	}
	return changes, s.tally.Stale(), lost, s.tally.Violations()
}
