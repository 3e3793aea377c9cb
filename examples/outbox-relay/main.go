// Command outbox-relay runs the transactional outbox end to end: orders and
// their events are written in one transaction, a relay publishes the events
// to Kafka stamped with a caughtup token, and a consumer routes each event
// with the token before reading the order — first while the replica's
// replay is paused (the event must read the primary), then while it
// streams (the event reads the replica). It prints one summary line,
//
//	outbox-relay: relay=polling events=20 delivered=20 | replica paused, sticky: replica=0 primary=10 | replica streaming, delayed: replica=10 primary=0 | stale reads=0
//
// the same on every correct run.
//
// Without configuration it starts its own PostgreSQL primary with one
// streaming replica (PostgreSQL 15 server binaries must be installed) and a
// single-node Apache Kafka 4.4 broker (Java 17; the jars come from Maven
// Central, see scripts/install-deps), and creates a topic of one partition
// on it. To use existing services instead set
//
//	OUTBOX_PRIMARY_DSN  primary, superuser (creates the tables orders and the
//	                    outbox's; the logical relay a publication and a slot)
//	OUTBOX_REPLICA_DSN  a streaming replica of it (superuser: pauses replay)
//	KAFKA_BROKERS       comma-separated brokers
//	OUTBOX_TOPIC        the topic, read from its first offset at partition 0:
//	                    created (one partition) if it does not exist; default
//	                    caughtup-outbox-example-<time>, a new one every run
//
// and OUTBOX_RELAY=logical for the logical-replication relay instead of
// the polling one.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/outbox"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/examplesvc"
)

// config says which services to use; zero values start throwaway ones
// (the brokers come from $KAFKA_BROKERS, see examplesvc.Services.Kafka).
type config struct {
	PrimaryDSN, ReplicaDSN string
	Topic                  string
	Relay                  string // "polling" (default) or "logical"
	Events                 int    // per phase; default 10
}

func configFromEnv() config {
	return config{
		PrimaryDSN: os.Getenv("OUTBOX_PRIMARY_DSN"),
		ReplicaDSN: os.Getenv("OUTBOX_REPLICA_DSN"),
		Relay:      os.Getenv("OUTBOX_RELAY"),
		Topic:      os.Getenv("OUTBOX_TOPIC"),
	}
}

func main() {
	examplesvc.Main("outbox-relay", func(ctx context.Context, _ []string, stdout, stderr io.Writer) error {
		return run(ctx, stdout, stderr, configFromEnv())
	})
}

// summary is what the consumer saw.
type summary struct {
	delivered, duplicates, stale int
	phases                       [2]struct{ replica, primary int }
}

func run(ctx context.Context, out, stderr io.Writer, cfg config) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute) // services start slowly on a busy machine
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
		cfg.Topic = fmt.Sprintf("caughtup-outbox-example-%d", time.Now().UnixNano())
	}
	if cfg.PrimaryDSN != "" && cfg.ReplicaDSN == "" {
		return errors.New("OUTBOX_REPLICA_DSN is required with OUTBOX_PRIMARY_DSN")
	}

	// Services: throwaway ones unless configured.
	pg := examplesvc.PostgresConfig{PrimaryURL: cfg.PrimaryDSN, Replicas: 1, PrimaryEnv: "OUTBOX_PRIMARY_DSN"}
	if cfg.ReplicaDSN != "" {
		pg.ReplicaURLs = []string{cfg.ReplicaDSN}
	}
	svc, err := examplesvc.StartPostgres(ctx, stderr, pg)
	if err != nil {
		return err
	}
	defer svc.Close()
	primary, replica := svc.Primary, svc.Replicas[0]
	brokers, err := svc.Kafka(ctx, stderr)
	if err != nil {
		return err
	}
	// One partition: the reader below reads partition 0.
	if err := svc.CreateTopic(ctx, cfg.Topic, 1); err != nil && !errors.Is(err, kafka.TopicAlreadyExists) {
		return err
	}

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
	writer := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: cfg.Topic, Balancer: &kafka.Hash{},
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
		lr, err = outbox.NewLogicalRelay(outbox.LogicalConfig{ConnString: primary.Config().ConnString(), Publisher: pub, Logger: quiet})
		if err == nil {
			err = lr.Setup(ctx)
			defer func() { _ = lr.Teardown(context.WithoutCancel(ctx)) }()
		}
		relay = lr
	}
	if err != nil {
		return err
	}
	stopRelay := examplesvc.Go(ctx, relay.Run)
	defer stopRelay()

	// The consumer: one router for the process.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:  map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replica)}},
		WaitBudget: 10 * time.Second,
		Logger:     quiet,
	})
	if err != nil {
		return err
	}
	defer func() { _ = router.Close() }()
	reader := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: cfg.Topic, MaxWait: 20 * time.Millisecond})
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
			jobCtx, d, err := router.Route(ctx, consume.Job{Token: tok, TokenErr: decodeErr, Policy: policy})
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
	if err := writeOrders(ctx, primary, cfg.Topic, 1, cfg.Events); err != nil {
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
	if err := writeOrders(ctx, primary, cfg.Topic, 1000, cfg.Events); err != nil {
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
func writeOrders(ctx context.Context, primary *pgxpool.Pool, topic string, from, n int) error {
	for i := from; i < from+n; i++ {
		err := pgx.BeginFunc(ctx, primary, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO orders (id, item) VALUES ($1, 'book')", i); err != nil {
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
