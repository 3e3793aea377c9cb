// Command debezium-consumer is caughtup's Kafka adapter on a Debezium
// topic: transactions on the primary bump per-key counters, the Debezium
// PostgreSQL connector (Kafka Connect, pgoutput) streams each change to
// Kafka, and a consumer group reads the topic with TokenSource
// TokenDebezium. Each handler reads the changed row from the pool caughtup
// chose for the event. It prints
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
// One command runs it on the demo's cluster (a primary with two streaming
// replicas, a Kafka broker and a Kafka Connect worker with the Debezium
// PostgreSQL connector; replay paused at random on the replicas):
//
//	make example EXAMPLE=debezium-consumer
//
// that is,
//
//	go run ./cmd/caughtup-demo cluster -debezium -max-pause 1s -- go run ./examples/debezium-consumer
//
// On your own services:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	KAFKA_BROKERS=kafka1:9092 KAFKA_CONNECT_URL=http://connect:8083 \
//	go run ./examples/debezium-consumer -transactions 1000
//
// The primary needs wal_level = logical and a user with REPLICATION that
// may create a publication, and the Connect worker the Debezium PostgreSQL
// connector plugin and a route to the primary at the host and port of
// CAUGHTUP_PRIMARY_URL. The program creates the table
// caughtup_cdc_example_counters (dropping an old one), a topic for its
// changes and a connector with its slot and publication, and deletes the
// connector, the slot and the publication when it is done.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
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
	kafkago "github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/replay"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "debezium-consumer:", err)
		os.Exit(1)
	}
}

const table = "caughtup_cdc_example_counters"

type options struct {
	transactions, keys, partitions int
	timeout                        time.Duration
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	var o options
	fs := flag.NewFlagSet("debezium-consumer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.transactions, "transactions", 200, "transactions to run, each bumping one or two counters")
	fs.IntVar(&o.keys, "keys", 8, "distinct counters (rows, and so message keys)")
	fs.IntVar(&o.partitions, "partitions", 4, "partitions of the change topic")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long to wait for every change once made; the rest are lost")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.transactions < 1 || o.keys < 1 || o.partitions < 1 {
		return errors.New("-transactions, -keys and -partitions must be positive")
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
	connectURL, err := need(getenv, "KAFKA_CONNECT_URL", "the REST URL of a Kafka Connect worker with the Debezium PostgreSQL connector")
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
	if _, err := primary.Exec(ctx, `DROP TABLE IF EXISTS `+table+`; CREATE TABLE `+table+` (key text PRIMARY KEY, seq int NOT NULL)`); err != nil {
		return err
	}
	// The connector writes changes of public.<table> to
	// <prefix>.public.<table>; created first with the partitions we want
	// (Connect would create it with the broker's default).
	prefix := fmt.Sprintf("caughtup_cdc_example_%d", time.Now().UnixNano())
	topic := prefix + ".public." + table
	if err := createTopic(ctx, brokers, topic, o.partitions); err != nil {
		return err
	}
	stopConnector, err := startConnector(ctx, connectURL, prefix, primary)
	if err != nil {
		return err
	}
	defer func() {
		if err := stopConnector(); err != nil {
			fmt.Fprintln(stderr, "debezium-consumer:", err)
		}
	}()

	metrics := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(metrics))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// The consumer side: one router per process; the consumer reads the
	// Debezium topic and routes each change by its source position.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replicas...)}},
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
	consumerCtx, stopConsumer := context.WithCancel(ctx)
	defer stopConsumer()
	consumerDone := make(chan error, 1)
	go func() { consumerDone <- consumer.Run(consumerCtx) }()

	// The producer side: plain transactions; Debezium does the rest.
	final, err := produce(ctx, primary, o)
	if err != nil {
		return err
	}
	st.expect(final)
	timer := time.NewTimer(o.timeout)
	defer timer.Stop()
	select {
	case <-st.all:
	case <-timer.C: // the summary counts the missing changes as lost
	case err := <-consumerDone:
		return fmt.Errorf("consumer stopped: %w", err)
	case <-ctx.Done():
		return ctx.Err()
	}
	stopConsumer()
	if err := <-consumerDone; err != nil && !errors.Is(err, context.Canceled) {
		return err
	}

	changes, stale, lost, violations := st.summary()
	fmt.Fprintf(stdout, "changes=%d stale=%d lost=%d order_violations=%d\n", changes, stale, lost, violations)
	fmt.Fprintf(stderr, "outcomes: %s\n", st.outcomes())
	checks, err := counterSums(ctx, metrics, "caughtup.cdc.checks", "caughtup.reason")
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "commit-safe checks on replicas, by reason: %s\n", checks)
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
	return "", fmt.Errorf("%s is not set: it names %s (`make example EXAMPLE=debezium-consumer` starts the demo's cluster and sets it)", name, what)
}

// startConnector creates the Debezium PostgreSQL connector name on the
// Kafka Connect worker at connectURL, capturing public.<table> of the
// primary's database into the topic <name>.public.<table>, and returns
// once it streams: a change committed from then on reaches the topic.
// stop deletes the connector, its slot and its publication.
func startConnector(ctx context.Context, connectURL, name string, primary *pgxpool.Pool) (stop func() error, err error) {
	cc := primary.Config().ConnConfig
	config := map[string]string{
		"connector.class":             "io.debezium.connector.postgresql.PostgresConnector",
		"plugin.name":                 "pgoutput",
		"database.hostname":           cc.Host,
		"database.port":               strconv.Itoa(int(cc.Port)),
		"database.user":               cc.User,
		"database.password":           cc.Password,
		"database.dbname":             cc.Database,
		"topic.prefix":                name,
		"table.include.list":          "public." + table,
		"slot.name":                   name,
		"publication.name":            name,
		"publication.autocreate.mode": "filtered", // for the captured table only
		"slot.drop.on.stop":           "true",     // a slot left behind holds WAL forever
		"poll.interval.ms":            "50",       // Debezium's default waits 500 ms
		// Plain JSON envelopes, whatever the worker's defaults: what
		// TokenDebezium parses.
		"key.converter":                  "org.apache.kafka.connect.json.JsonConverter",
		"value.converter":                "org.apache.kafka.connect.json.JsonConverter",
		"key.converter.schemas.enable":   "false",
		"value.converter.schemas.enable": "false",
	}
	if _, err := connectRequest(ctx, http.MethodPost, connectURL+"/connectors", map[string]any{"name": name, "config": config}); err != nil {
		return nil, err
	}
	stop = func() error {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_, err := connectRequest(ctx, http.MethodDelete, connectURL+"/connectors/"+name, nil)
		// The connector drops its slot as it stops; one that failed cannot.
		for err == nil {
			var exists, active bool
			err = primary.QueryRow(ctx, `SELECT count(*) > 0, coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1`, name).Scan(&exists, &active)
			if err != nil || !exists {
				break
			}
			if !active {
				_, err = primary.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, name)
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		_, perr := primary.Exec(ctx, `DROP PUBLICATION IF EXISTS `+name)
		return errors.Join(err, perr)
	}

	// Streaming: the walsender of the connector's slot says so. Debezium
	// streams only after its snapshot, so no later change is missed or
	// reported as a snapshot read.
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for {
		var state string
		err := primary.QueryRow(ctx, `SELECT coalesce(r.state, '') FROM pg_replication_slots s
			LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1`, name).Scan(&state)
		if err == nil && state == "streaming" {
			return stop, nil
		}
		status, serr := connectRequest(ctx, http.MethodGet, connectURL+"/connectors/"+name+"/status", nil)
		failed := serr == nil && bytes.Contains(status, []byte(`"FAILED"`)) // the task's trace says why
		if failed || err != nil && !errors.Is(err, pgx.ErrNoRows) || ctx.Err() != nil {
			return nil, errors.Join(fmt.Errorf("connector %s not streaming: %w; status %s", name, errors.Join(err, ctx.Err()), status), stop())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// connectRequest sends a request to Kafka Connect's REST API and returns
// the response body; a status of 300 or more is an error.
func connectRequest(ctx context.Context, method, url string, body any) ([]byte, error) {
	var r io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, r)
	if err != nil {
		return nil, fmt.Errorf("KAFKA_CONNECT_URL: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Close = true // one connection per request: none left open when the program ends
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("kafka connect: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode >= 300 {
		err = fmt.Errorf("kafka connect: %s %s: %s: %s", method, url, resp.Status, bytes.TrimSpace(b))
	}
	return b, err
}

// createTopic creates topic and waits until every partition has a leader:
// a consumer group that joins before that is assigned no partitions.
func createTopic(ctx context.Context, brokers []string, topic string, partitions int) error {
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	c := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: tr}
	resp, err := c.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{
		{Topic: topic, NumPartitions: partitions, ReplicationFactor: -1}, // -1: the brokers' default
	}})
	if err == nil {
		err = resp.Errors[topic]
	}
	if err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	for {
		md, err := c.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic}})
		if err == nil && len(md.Topics) == 1 && len(md.Topics[0].Partitions) == partitions &&
			!slices.ContainsFunc(md.Topics[0].Partitions, func(p kafkago.Partition) bool { return p.Leader.Host == "" }) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("topic %s has partitions without a leader: %w", topic, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// produce inserts the counters, then runs the transactions, each adding 1
// to one counter or, one in five, to two at once, and returns every
// counter's final value.
func produce(ctx context.Context, primary *pgxpool.Pool, o options) (map[string]int, error) {
	for k := range o.keys {
		if _, err := primary.Exec(ctx, `INSERT INTO `+table+` VALUES ($1, 0)`, fmt.Sprintf("user-%d", k)); err != nil {
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
		err := pgx.BeginFunc(ctx, primary, func(tx pgx.Tx) error {
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
	rows, err := primary.Query(ctx, `SELECT key, seq FROM `+table)
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
// to the final value, in order.
type stats struct {
	mu         sync.Mutex
	next       map[string]int // per key: how many of its leading changes ran
	where      map[string]int // per outcome (and replica): how many reads
	stale      int
	violations int
	final      map[string]int // per key: the last change; nil until known
	all        chan struct{}  // closed once every key's last change ran
	closed     bool
}

func newStats() *stats {
	return &stats{next: map[string]int{}, where: map[string]int{}, all: make(chan struct{})}
}

// handle is the message handler: it reads the changed row from the pool
// caughtup chose and records what it found.
func (s *stats) handle(ctx context.Context, msg kafkago.Message) error {
	var ev struct {
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
	switch n := s.next[ev.After.Key]; {
	case ev.After.Seq == n:
		s.next[ev.After.Key] = n + 1
	case ev.After.Seq > n: // an earlier change of the key has not run yet
		s.violations++
	} // Seq < n: a redelivery, no violation
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
		if s.next[k] <= last {
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
		if n := s.next[k]; n <= last {
			lost += last + 1 - n
		}
	}
	return changes, s.stale, lost, s.violations
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
