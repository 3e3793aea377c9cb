// Package examplesvc gives the programs under examples/ their services:
// the ones the environment names, or throwaway ones started with pgtest
// and kafkatest (a real Kafka broker and Kafka Connect with Debezium; Java
// 17 and the jars scripts/install-deps resolves), so that every example
// runs on a fresh machine with no flags.
package examplesvc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Services are an example's connections. Close releases them and stops
// whatever was started.
type Services struct {
	Primary  *pgxpool.Pool
	Replicas []*pgxpool.Pool
	// Cluster is the throwaway cluster, nil when the environment named
	// the databases; examples inject lag only into their own.
	Cluster *pgtest.Cluster
	broker  *kafkatest.Broker
	closers []func()
}

// Close stops everything in reverse order of start.
func (s *Services) Close() {
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
	s.closers = nil
}

// PostgresConfig says which PostgreSQL an example uses.
type PostgresConfig struct {
	// PrimaryURL names an existing primary, and ReplicaURLs its streaming
	// replicas. Empty: a throwaway primary is started, with Replicas
	// replicas, and a fresh database "example" on it is used.
	PrimaryURL  string
	ReplicaURLs []string
	// Replicas is how many streaming replicas a throwaway cluster gets.
	// Default 2: enough to show a router choosing among them.
	Replicas int
	// PrimaryEnv names the variable that sets PrimaryURL, for the line that
	// says how to use your own. Default "CAUGHTUP_PRIMARY_URL".
	PrimaryEnv string
}

// Postgres connects to $CAUGHTUP_PRIMARY_URL and the comma-separated
// $CAUGHTUP_REPLICA_URLS, or starts a primary with two streaming replicas
// and uses a fresh database "example" on it.
func Postgres(ctx context.Context, stderr io.Writer) (*Services, error) {
	cfg := PostgresConfig{PrimaryURL: os.Getenv("CAUGHTUP_PRIMARY_URL")}
	if v := os.Getenv("CAUGHTUP_REPLICA_URLS"); v != "" {
		cfg.ReplicaURLs = strings.Split(v, ",")
	}
	return StartPostgres(ctx, stderr, cfg)
}

// StartPostgres connects to the servers cfg names, or starts a throwaway
// cluster (testkit/pgtest) that Close stops.
func StartPostgres(ctx context.Context, stderr io.Writer, cfg PostgresConfig) (s *Services, err error) {
	s = &Services{}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	primaryURL, replicaURLs := cfg.PrimaryURL, cfg.ReplicaURLs
	if primaryURL == "" {
		if cfg.Replicas <= 0 {
			cfg.Replicas = 2
		}
		if cfg.PrimaryEnv == "" {
			cfg.PrimaryEnv = "CAUGHTUP_PRIMARY_URL"
		}
		replicas := fmt.Sprintf("%d streaming replicas", cfg.Replicas)
		if cfg.Replicas == 1 {
			replicas = "one streaming replica"
		}
		fmt.Fprintf(stderr, "starting a primary with %s (set %s to use your own)\n", replicas, cfg.PrimaryEnv)
		c, err := pgtest.Start(ctx, pgtest.Options{Replicas: cfg.Replicas})
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
// single-node Apache Kafka 4 broker (testkit/kafkatest) that Close stops.
func (s *Services) Kafka(ctx context.Context, stderr io.Writer) ([]string, error) {
	if os.Getenv("KAFKA_BROKERS") == "" {
		fmt.Fprintln(stderr, "starting a Kafka broker (set KAFKA_BROKERS to use your own)")
	}
	b, err := kafkatest.Start(ctx, kafkatest.Options{}) // $KAFKA_BROKERS: starts nothing
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, func() { _ = b.Close() })
	s.broker = b
	return b.Brokers(), nil
}

// CreateTopic creates a topic on the brokers Kafka returned, with the
// cluster's default replication factor, and waits until every partition
// has a leader: a consumer group that joins before that gets no partitions.
func (s *Services) CreateTopic(ctx context.Context, name string, partitions int) error {
	if s.broker == nil {
		return errors.New("examplesvc: CreateTopic before Kafka")
	}
	return s.broker.CreateTopic(ctx, name, partitions)
}

// PauseReplay injects lag into a throwaway cluster: until stop is called
// it pauses replay on its replicas at random for up to maxPause at a time
// (pgtest's Cluster.PauseRandomly), reporting each pause on stderr. On
// servers the environment named, or with maxPause 0, it does nothing.
// stop resumes replay and waits; calling it again does nothing.
func (s *Services) PauseReplay(ctx context.Context, maxPause time.Duration, stderr io.Writer) (stop func()) {
	if s.Cluster == nil || maxPause <= 0 {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		s.Cluster.PauseRandomly(ctx, maxPause, 300*time.Millisecond, func(f string, a ...any) { fmt.Fprintf(stderr, f+"\n", a...) })
	})
	return func() {
		cancel()
		wg.Wait()
	}
}

// Debezium starts a Kafka Connect worker (testkit/kafkatest) against
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
