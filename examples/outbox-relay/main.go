// Command outbox-relay runs the transactional outbox end to end: orders and
// their events are written in one transaction, a relay publishes the events
// to Kafka stamped with a caughtup token, and a consumer routes each event
// with the token before reading its order. It prints
//
//	relay=polling events=20 delivered=20 stale=0 lost=0
//
// on stdout (a stale event read a replica that did not have its order yet;
// a lost one never arrived) and on stderr where the reads went.
//
// One command runs it on the demo's cluster (a primary with two streaming
// replicas and a Kafka broker, replay paused at random on the replicas):
//
//	make example EXAMPLE=outbox-relay
//
// that is,
//
//	go run ./cmd/caughtup-demo cluster -kafka -max-pause 1s -- go run ./examples/outbox-relay
//
// On your own services:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	KAFKA_BROKERS=kafka1:9092 go run ./examples/outbox-relay -relay logical
//
// It creates the outbox's tables (outbox.Migrate) and the table
// caughtup_outbox_example_orders (dropping an old one), and a topic of one
// partition named caughtup-outbox-example-<time>. -relay logical needs
// wal_level = logical and a user that may create a publication and a slot.
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
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/outbox"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-relay:", err)
		os.Exit(1)
	}
}

const orders = "caughtup_outbox_example_orders"

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("outbox-relay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	relayKind := fs.String("relay", "polling", "the relay: polling (reads the outbox table) or logical (logical replication)")
	events := fs.Int("events", 20, "orders to write, each with its event")
	policyName := fs.String("policy", "delayed", "for an event the replicas have not replayed yet: delayed (wait for one) or sticky (read the primary)")
	timeout := fs.Duration("timeout", 2*time.Minute, "how long to wait for every event; the rest are lost")
	if err := fs.Parse(args); err != nil {
		return err
	}
	policy, ok := map[string]consume.Policy{"delayed": consume.Delayed, "sticky": consume.Sticky}[*policyName]
	if *relayKind != "polling" && *relayKind != "logical" || !ok || *events < 1 {
		return errors.New("-relay must be polling or logical, -policy delayed or sticky, and -events positive")
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
	// One partition: the reader below reads partition 0.
	topic := fmt.Sprintf("caughtup-outbox-example-%d", time.Now().UnixNano())
	if err := createTopic(ctx, brokers, topic, 1); err != nil {
		return err
	}

	// Schema: the outbox next to the business table.
	if err := outbox.Migrate(ctx, primary); err != nil {
		return err
	}
	if _, err := primary.Exec(ctx, `DROP TABLE IF EXISTS `+orders+`; CREATE TABLE `+orders+` (id bigint PRIMARY KEY, item text NOT NULL)`); err != nil {
		return err
	}

	// The relay: outbox → Kafka, every message stamped.
	transport := &kafka.Transport{}
	defer transport.CloseIdleConnections()
	writer := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{},
		RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, Transport: transport}
	defer func() { _ = writer.Close() }()
	pub, err := caughtupkafka.NewOutboxPublisher(writer)
	if err != nil {
		return err
	}
	quiet := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	var relay interface{ Run(context.Context) error }
	switch *relayKind {
	case "polling":
		relay, err = outbox.NewPollingRelay(outbox.PollingConfig{Primary: primary, Publisher: pub, PollInterval: 10 * time.Millisecond, Logger: quiet})
	case "logical":
		var lr *outbox.LogicalRelay
		lr, err = outbox.NewLogicalRelay(outbox.LogicalConfig{ConnString: primaryURL, Publisher: pub, Logger: quiet})
		if err == nil {
			err = lr.Setup(ctx) // the publication and the slot
			// After the relay stops (deferred later, so run earlier): the
			// slot would hold WAL for as long as it exists.
			defer func() {
				if err := lr.Teardown(context.WithoutCancel(ctx)); err != nil {
					fmt.Fprintf(stderr, "teardown: %v\n", err)
				}
			}()
		}
		relay = lr
	}
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	defer func() {
		stopRelay()
		<-relayDone
	}()

	// The consumer: one router for the process.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:  map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replicas...)}},
		WaitBudget: 10 * time.Second,
		Logger:     quiet,
	})
	if err != nil {
		return err
	}
	defer func() { _ = router.Close() }()

	// The producer: each order and its event in one transaction, so the
	// event exists if and only if the order does.
	for i := 1; i <= *events; i++ {
		err := pgx.BeginFunc(ctx, primary, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` (id, item) VALUES ($1, 'book')`, i); err != nil {
				return err
			}
			id := strconv.Itoa(i)
			_, err := outbox.Insert(ctx, tx, outbox.Event{Topic: topic, Key: []byte(id), Payload: []byte(`{"order":` + id + `}`)})
			return err
		})
		if err != nil {
			return err
		}
	}

	// The consumer reads each event, routes it by the token the relay
	// stamped on it, and reads the order from the pool it was given.
	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, MaxWait: 20 * time.Millisecond})
	defer func() { _ = reader.Close() }()
	readCtx, cancelRead := context.WithTimeout(ctx, *timeout)
	defer cancelRead()
	seen := map[string]bool{}
	var stale, duplicates, onReplica, onPrimary int
	for len(seen) < *events {
		m, err := reader.ReadMessage(readCtx)
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			break // the summary counts the missing events as lost
		}
		if err != nil {
			return fmt.Errorf("read from Kafka: %w", err)
		}
		// A malformed token routes to the primary: Route takes the decode
		// error as Job.TokenErr.
		tok, decodeErr := position.DecodeHeaders(headers(m.Headers, position.HeaderName)...)
		id := headers(m.Headers, outbox.HeaderEventID)[0]
		if seen[id] { // at-least-once delivery: dedupe on the event ID
			duplicates++
			continue
		}
		seen[id] = true
		jobCtx, d, err := router.Route(ctx, consume.Job{Token: tok, TokenErr: decodeErr, Policy: policy})
		if err != nil {
			return fmt.Errorf("route event %s: %w", id, err)
		}
		if dd, _ := d.Database("main"); dd.Replica != "" {
			onReplica++
		} else {
			onPrimary++
		}
		var n int
		if err := consume.DB(jobCtx, "main").QueryRow(ctx, `SELECT count(*) FROM `+orders+` WHERE id = $1`, string(m.Key)).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			stale++
		}
	}

	fmt.Fprintf(stdout, "relay=%s events=%d delivered=%d stale=%d lost=%d\n", *relayKind, *events, len(seen), stale, *events-len(seen))
	fmt.Fprintf(stderr, "reads: replica=%d primary=%d duplicates=%d\n", onReplica, onPrimary, duplicates)
	return nil
}

// need returns the environment variable name, or an error that names it.
func need(getenv func(string) string, name, what string) (string, error) {
	if v := strings.TrimSpace(getenv(name)); v != "" {
		return v, nil
	}
	return "", fmt.Errorf("%s is not set: it names %s (`make example EXAMPLE=outbox-relay` starts the demo's cluster and sets it)", name, what)
}

// createTopic creates topic and waits until every partition has a leader:
// a reader that starts before that fails its first fetches.
func createTopic(ctx context.Context, brokers []string, topic string, partitions int) error {
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	c := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: tr}
	resp, err := c.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{
		{Topic: topic, NumPartitions: partitions, ReplicationFactor: -1}, // -1: the brokers' default
	}})
	if err == nil {
		err = resp.Errors[topic]
	}
	if err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	for {
		md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
		if err == nil && len(md.Topics) == 1 && len(md.Topics[0].Partitions) == partitions &&
			!slices.ContainsFunc(md.Topics[0].Partitions, func(p kafka.Partition) bool { return p.Leader.Host == "" }) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("topic %s has partitions without a leader: %w", topic, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// headers returns the values of every header named key ("" if none).
func headers(hs []kafka.Header, key string) []string {
	var out []string
	for _, h := range hs {
		if h.Key == key {
			out = append(out, string(h.Value))
		}
	}
	if len(out) == 0 {
		out = append(out, "")
	}
	return out
}
