// Package examplesvc gives the programs under examples/ their services:
// the ones the environment names, or throwaway ones started with pgtest
// and kafkatest (a real Kafka broker and Kafka Connect with Debezium; Java
// 17 and the jars scripts/install-deps resolves), so that every example
// runs on a fresh machine with no flags.
package examplesvc

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/internal/kafkatest"
	"github.com/caughtup/caughtup/internal/pgtest"
)

// Services are an example's connections. Close releases them and stops
// whatever was started.
type Services struct {
	Primary  *pgxpool.Pool
	Replicas []*pgxpool.Pool
	// Cluster is the throwaway cluster, nil when the environment named
	// the databases; examples inject lag only into their own.
	Cluster *pgtest.Cluster
	closers []func()
}

// Close stops everything in reverse order of start.
func (s *Services) Close() {
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
	s.closers = nil
}

// Postgres connects to $CAUGHTUP_PRIMARY_URL and the comma-separated
// $CAUGHTUP_REPLICA_URLS, or starts a primary with two streaming replicas
// and uses a fresh database "example" on it.
func Postgres(ctx context.Context, stderr io.Writer) (s *Services, err error) {
	s = &Services{}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	primaryURL := os.Getenv("CAUGHTUP_PRIMARY_URL")
	var replicaURLs []string
	if v := os.Getenv("CAUGHTUP_REPLICA_URLS"); v != "" {
		replicaURLs = strings.Split(v, ",")
	}
	if primaryURL == "" {
		fmt.Fprintln(stderr, "starting a primary with two streaming replicas (set CAUGHTUP_PRIMARY_URL to use your own)")
		c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 2})
		if err != nil {
			return nil, err
		}
		s.closers = append(s.closers, func() { _ = c.Close() })
		s.Cluster = c
		if err := c.CreateDatabase(ctx, "example"); err != nil {
			return nil, err
		}
		primaryURL = c.Primary().DSN("example")
		replicaURLs = nil
		for _, n := range c.Replicas() {
			replicaURLs = append(replicaURLs, n.DSN("example"))
		}
	}
	if s.Primary, err = pgxpool.New(ctx, primaryURL); err != nil {
		return nil, err
	}
	s.closers = append(s.closers, s.Primary.Close)
	for _, u := range replicaURLs {
		p, err := pgxpool.New(ctx, strings.TrimSpace(u))
		if err != nil {
			return nil, err
		}
		s.closers = append(s.closers, p.Close)
		s.Replicas = append(s.Replicas, p)
	}
	return s, nil
}

// Redis returns $REDIS_ADDR, or starts a throwaway redis-server.
func (s *Services) Redis(ctx context.Context, stderr io.Writer) (string, error) {
	if addr := os.Getenv("REDIS_ADDR"); addr != "" {
		return addr, nil
	}
	fmt.Fprintln(stderr, "starting redis-server (set REDIS_ADDR to use your own)")
	r, err := pgtest.StartRedis(ctx)
	if err != nil {
		return "", err
	}
	s.closers = append(s.closers, func() { _ = r.Close() })
	return r.Addr(), nil
}

// Kafka returns the comma-separated $KAFKA_BROKERS, or starts a
// single-node Apache Kafka 4 broker (internal/kafkatest) that Close stops.
func (s *Services) Kafka(ctx context.Context, stderr io.Writer) ([]string, error) {
	if b := os.Getenv("KAFKA_BROKERS"); b != "" {
		return strings.Split(b, ","), nil
	}
	fmt.Fprintln(stderr, "starting a Kafka broker (set KAFKA_BROKERS to use your own)")
	b, err := kafkatest.Start(ctx, kafkatest.Options{})
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, func() { _ = b.Close() })
	return b.Brokers(), nil
}

// Debezium starts a Kafka Connect worker (internal/kafkatest) against
// brokers, and on it a Debezium PostgreSQL connector (pgoutput) that
// captures tables ("schema.table", which must exist) of the primary's
// database into the topics "<prefix>.<schema>.<table>", and returns once
// it streams. The primary must have wal_level = logical and its user the
// REPLICATION attribute and the right to create a publication (the
// throwaway cluster's "postgres" has both). Close deletes the connector,
// its slot and its publication, and stops the worker.
func (s *Services) Debezium(ctx context.Context, stderr io.Writer, brokers []string, prefix string, tables ...string) error {
	src, err := kafkatest.PostgresFromDSN(s.Primary.Config().ConnString())
	if err != nil {
		return err
	}
	fmt.Fprintln(stderr, "starting Kafka Connect with the Debezium PostgreSQL connector")
	c, err := kafkatest.StartConnect(ctx, brokers, kafkatest.ConnectOptions{})
	if err != nil {
		return err
	}
	s.closers = append(s.closers, func() { _ = c.Close() })
	pc, err := c.StartPostgresConnector(ctx, prefix, kafkatest.DebeziumPostgres{Postgres: src, Tables: tables, TopicPrefix: prefix})
	if err != nil {
		return err
	}
	s.closers = append(s.closers, func() {
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = pc.Delete(dctx)
	})
	return nil
}
