// Command outbox-relay runs the transactional outbox end to end: orders and
// their events are written in one transaction, a relay publishes the events
// to Kafka stamped with a caughtup token, and a consumer routes each event
// with the token before reading the order — first while the replica's
// replay is paused (the event must read the primary), then while it
// streams (the event reads the replica). It prints one summary line.
//
// Without configuration it starts its own PostgreSQL primary and replica
// (internal/pgtest, from the machine's PostgreSQL 15 binaries) and an
// in-process Kafka broker (kfake). To use real services set
//
//	OUTBOX_PRIMARY_DSN  primary, superuser (creates a table, a publication, a slot)
//	OUTBOX_REPLICA_DSN  a streaming replica of it (superuser: pauses replay)
//	KAFKA_BROKERS       comma-separated brokers; the topic must exist
//
// and OUTBOX_RELAY=logical for the logical-replication relay instead of
// the polling one.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/pgtest"
	caughtupkafka "github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/outbox"
	"github.com/caughtup/caughtup/position"
)

// config says which services to use; zero values start throwaway ones.
type config struct {
	PrimaryDSN, ReplicaDSN string
	Brokers                []string
	Topic                  string
	Relay                  string // "polling" (default) or "logical"
	Events                 int    // per phase; default 10
}

func configFromEnv() config {
	cfg := config{
		PrimaryDSN: os.Getenv("OUTBOX_PRIMARY_DSN"),
		ReplicaDSN: os.Getenv("OUTBOX_REPLICA_DSN"),
		Relay:      os.Getenv("OUTBOX_RELAY"),
		Topic:      os.Getenv("OUTBOX_TOPIC"),
	}
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		cfg.Brokers = strings.Split(b, ",")
	}
	return cfg
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Stdout, configFromEnv()); err != nil {
		log.Fatal(err)
	}
}

// summary is what the consumer saw.
type summary struct {
	delivered, duplicates, stale int
	phases                       [2]struct{ replica, primary int }
}

func run(ctx context.Context, out io.Writer, cfg config) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	if cfg.Relay == "" {
		cfg.Relay = "polling"
	}
	if cfg.Relay != "polling" && cfg.Relay != "logical" {
		return fmt.Errorf("OUTBOX_RELAY=%q: want polling or logical", cfg.Relay)
	}
	if cfg.Events <= 0 {
		cfg.Events = 10
	}
	if cfg.Topic == "" {
		cfg.Topic = "orders"
	}

	// Services: throwaway ones unless configured.
	if cfg.PrimaryDSN == "" {
		cluster, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1})
		if err != nil {
			return err
		}
		defer func() { _ = cluster.Close() }()
		if err := cluster.CreateDatabase(ctx, "shop"); err != nil {
			return err
		}
		cfg.PrimaryDSN, cfg.ReplicaDSN = cluster.Primary().DSN("shop"), cluster.Replicas()[0].DSN("shop")
	}
	if cfg.ReplicaDSN == "" {
		return errors.New("OUTBOX_REPLICA_DSN is required with OUTBOX_PRIMARY_DSN")
	}
	if len(cfg.Brokers) == 0 {
		kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, cfg.Topic))
		if err != nil {
			return err
		}
		defer kc.Close()
		cfg.Brokers = kc.ListenAddrs()
	}
	primary, err := pgxpool.New(ctx, cfg.PrimaryDSN)
	if err != nil {
		return err
	}
	defer primary.Close()
	replica, err := pgxpool.New(ctx, cfg.ReplicaDSN)
	if err != nil {
		return err
	}
	defer replica.Close()

	// Schema: the outbox next to the business table.
	if err := outbox.Migrate(ctx, primary); err != nil {
		return err
	}
	if _, err := primary.Exec(ctx, "CREATE TABLE IF NOT EXISTS orders (id bigint PRIMARY KEY, item text NOT NULL)"); err != nil {
		return err
	}

	// The relay: outbox → Kafka, every message stamped.
	transport := &kafka.Transport{}
	defer transport.CloseIdleConnections()
	writer := &kafka.Writer{Addr: kafka.TCP(cfg.Brokers...), Topic: cfg.Topic, Balancer: &kafka.Hash{},
		RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, Transport: transport}
	defer func() { _ = writer.Close() }()
	pub, err := caughtupkafka.NewOutboxPublisher(writer)
	if err != nil {
		return err
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var relay interface{ Run(context.Context) error }
	switch cfg.Relay {
	case "polling":
		relay, err = outbox.NewPollingRelay(outbox.PollingConfig{Primary: primary, Publisher: pub, PollInterval: 10 * time.Millisecond, Logger: quiet})
	case "logical":
		var lr *outbox.LogicalRelay
		lr, err = outbox.NewLogicalRelay(outbox.LogicalConfig{ConnString: cfg.PrimaryDSN, Publisher: pub, Logger: quiet})
		if err == nil {
			err = lr.Setup(ctx)
			defer func() { _ = lr.Teardown(context.WithoutCancel(ctx)) }()
		}
		relay = lr
	}
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	defer func() { stopRelay(); <-relayDone }()

	// The consumer: one router for the process.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:  map[string]consume.Database{"main": {Primary: primary, Replicas: consume.Replicas(replica)}},
		WaitBudget: 10 * time.Second,
		Logger:     quiet,
	})
	if err != nil {
		return err
	}
	defer func() { _ = router.Close() }()
	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: cfg.Brokers, Topic: cfg.Topic, MaxWait: 20 * time.Millisecond})
	defer func() { _ = reader.Close() }()

	var s summary
	seen := map[string]bool{}
	consumeN := func(phase int, policy consume.Policy, n int) error {
		for got := 0; got < n; {
			m, err := reader.ReadMessage(ctx)
			if err != nil {
				return fmt.Errorf("read from Kafka: %w", err)
			}
			// The relay stamped the token; a malformed one routes to the
			// primary (RouteDecoded takes the decode error as is).
			tok, decodeErr := position.DecodeHeaders(headers(m.Headers, position.HeaderName)...)
			id := headers(m.Headers, outbox.HeaderEventID)[0]
			if seen[id] { // at-least-once delivery: dedupe on the event ID
				s.duplicates++
				continue
			}
			seen[id] = true
			got++
			s.delivered++
			jobCtx, d, err := router.RouteDecoded(ctx, tok, decodeErr, policy)
			if err != nil {
				return fmt.Errorf("route event %s: %w", id, err)
			}
			if dd, _ := d.Database("main"); dd.Replica != "" {
				s.phases[phase].replica++
			} else {
				s.phases[phase].primary++
			}
			var n int
			if err := consume.DB(jobCtx, "main").QueryRow(ctx, "SELECT count(*) FROM orders WHERE id = $1", string(m.Key)).Scan(&n); err != nil {
				return err
			}
			if n == 0 {
				s.stale++
			}
		}
		return nil
	}

	// Phase 1: the replica stops replaying before the orders are written.
	// Every event's token is ahead of it; Sticky sends them to the primary.
	if err := pauseReplay(ctx, primary, replica); err != nil {
		return err
	}
	resumed := false
	defer func() {
		if !resumed {
			_, _ = replica.Exec(context.WithoutCancel(ctx), "SELECT pg_wal_replay_resume()")
		}
	}()
	if err := writeOrders(ctx, primary, 1, cfg.Events); err != nil {
		return err
	}
	if err := consumeN(0, consume.Sticky, cfg.Events); err != nil {
		return err
	}

	// Phase 2: replay streams again. Delayed waits the few milliseconds
	// until the replica has the order, then reads it there.
	if _, err := replica.Exec(ctx, "SELECT pg_wal_replay_resume()"); err != nil {
		return err
	}
	resumed = true
	if err := writeOrders(ctx, primary, 1000, cfg.Events); err != nil {
		return err
	}
	if err := consumeN(1, consume.Delayed, cfg.Events); err != nil {
		return err
	}

	_, err = fmt.Fprintf(out, "outbox-relay: relay=%s events=%d delivered=%d | replica paused, sticky: replica=%d primary=%d | replica streaming, delayed: replica=%d primary=%d | stale reads=%d\n",
		cfg.Relay, 2*cfg.Events, s.delivered, s.phases[0].replica, s.phases[0].primary, s.phases[1].replica, s.phases[1].primary, s.stale)
	return err
}

// writeOrders writes each order and its event in one transaction: the
// event exists if and only if the order does.
func writeOrders(ctx context.Context, primary *pgxpool.Pool, from, n int) error {
	for i := from; i < from+n; i++ {
		err := pgx.BeginFunc(ctx, primary, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO orders (id, item) VALUES ($1, 'book')", i); err != nil {
				return err
			}
			id := strconv.Itoa(i)
			_, err := outbox.Insert(ctx, tx, outbox.Event{Topic: "orders", Key: []byte(id), Payload: []byte(`{"order":` + id + `}`)})
			return err
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// pauseReplay pauses the replica's replay and waits until it has taken
// effect, which happens at the next WAL record: small transactions on the
// primary make sure there is one.
func pauseReplay(ctx context.Context, primary, replica *pgxpool.Pool) error {
	if _, err := replica.Exec(ctx, "SELECT pg_wal_replay_pause()"); err != nil {
		return fmt.Errorf("pause replay (needs superuser or pg_wal_replay_pause rights on the replica): %w", err)
	}
	for {
		var state string
		if err := replica.QueryRow(ctx, "SELECT pg_get_wal_replay_pause_state()").Scan(&state); err != nil {
			return err
		}
		if state == "paused" {
			return nil
		}
		if _, err := primary.Exec(ctx, "SELECT pg_current_xact_id()"); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
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
