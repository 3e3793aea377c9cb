// Package examplesvc starts the demo's cluster, the services the programs
// under examples/ run on: a PostgreSQL primary with two streaming replicas
// and redis-server (testkit/pgtest), and on request an Apache Kafka broker
// and a Kafka Connect worker with the Debezium PostgreSQL connector
// (testkit/kafkatest). Env says where they are in the variables the
// examples read, and PauseReplay injects the lag the examples must survive.
//
// `caughtup-demo cluster` and the examples' tests use it; the examples
// themselves import none of it, so that their main.go is what a user
// copies.
package examplesvc

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The variables the examples read.
const (
	// EnvPrimary is the primary's connection URL.
	EnvPrimary = "CAUGHTUP_PRIMARY_URL"
	// EnvReplicas are its streaming replicas' URLs, comma-separated.
	EnvReplicas = "CAUGHTUP_REPLICA_URLS"
	// EnvRedis is redis-server's host:port.
	EnvRedis = "REDIS_ADDR"
	// EnvKafka are the Kafka brokers' host:port, comma-separated.
	EnvKafka = "KAFKA_BROKERS"
	// EnvConnect is the Kafka Connect worker's REST URL.
	EnvConnect = "KAFKA_CONNECT_URL"
)

// Database is the database Start creates for the examples.
const Database = "example"

// Options says which services Start starts beyond PostgreSQL and Redis.
type Options struct {
	// Kafka starts a single-node Kafka broker, or uses the cluster
	// $KAFKA_BROKERS names (see kafkatest.Start).
	Kafka bool
	// Debezium starts a Kafka Connect worker with the Debezium PostgreSQL
	// connector against the broker; it implies Kafka.
	Debezium bool
	// Logf receives the services' progress messages. Default: discarded.
	Logf func(format string, args ...any)
}

// Cluster is the demo's cluster. Its fields are the harnesses, for tests
// that act on the servers directly (pause one replica, say).
type Cluster struct {
	PG      *pgtest.Cluster
	Redis   *pgtest.Redis
	Broker  *kafkatest.Broker  // nil without Options.Kafka
	Connect *kafkatest.Connect // nil without Options.Debezium
}

// Start starts the services opts asks for, PostgreSQL and Kafka side by
// side, and creates the database Database on the primary. On error nothing
// is left running.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	opts.Kafka = opts.Kafka || opts.Debezium
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	c := &Cluster{}
	var wg sync.WaitGroup
	var pgErr, kafkaErr error
	wg.Go(func() {
		if c.PG, pgErr = pgtest.Start(ctx, pgtest.Options{Replicas: 2, Logf: logf}); pgErr != nil {
			return
		}
		if pgErr = c.PG.CreateDatabase(ctx, Database); pgErr != nil {
			return
		}
		c.Redis, pgErr = pgtest.StartRedis(ctx)
	})
	if opts.Kafka {
		wg.Go(func() {
			if c.Broker, kafkaErr = kafkatest.Start(ctx, kafkatest.Options{Logf: logf}); kafkaErr != nil || !opts.Debezium {
				return
			}
			c.Connect, kafkaErr = kafkatest.StartConnect(ctx, c.Broker.Brokers(), kafkatest.ConnectOptions{Logf: logf})
		})
	}
	wg.Wait()
	if err := errors.Join(pgErr, kafkaErr); err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

// Env is the environment of an example on database (Database, or one the
// caller created with c.PG.CreateDatabase), as KEY=value strings: the
// primary's and replicas' URLs, Redis, and the Kafka broker and the
// Connect worker when started.
func (c *Cluster) Env(database string) []string {
	replicas := make([]string, 0, 2)
	for _, n := range c.PG.Replicas() {
		replicas = append(replicas, n.DSN(database))
	}
	env := []string{
		EnvPrimary + "=" + c.PG.Primary().DSN(database),
		EnvReplicas + "=" + strings.Join(replicas, ","),
		EnvRedis + "=" + c.Redis.Addr(),
	}
	if c.Broker != nil {
		env = append(env, EnvKafka+"="+strings.Join(c.Broker.Brokers(), ","))
	}
	if c.Connect != nil {
		env = append(env, EnvConnect+"="+c.Connect.URL())
	}
	return env
}

// Getenv is Env as a lookup function, for an example's run(..., getenv, ...).
func (c *Cluster) Getenv(database string) func(string) string {
	vars := map[string]string{}
	for _, kv := range c.Env(database) {
		k, v, _ := strings.Cut(kv, "=")
		vars[k] = v
	}
	return func(k string) string { return vars[k] }
}

// PauseReplay injects lag until stop is called: it pauses replay on one
// replica or both at random, for up to maxPause at a time with rests of
// up to 300 ms (pgtest's Cluster.PauseRandomly). Errors go to logf (nil
// discards them). maxPause <= 0 pauses nothing. stop resumes replay and
// waits; calling it again does nothing.
func (c *Cluster) PauseReplay(ctx context.Context, maxPause time.Duration, logf func(format string, args ...any)) (stop func()) {
	if maxPause <= 0 {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { c.PG.PauseRandomly(ctx, maxPause, 300*time.Millisecond, logf) })
	return sync.OnceFunc(func() {
		cancel()
		wg.Wait()
	})
}

// Close stops everything Start started, Kafka Connect first.
func (c *Cluster) Close() error {
	var errs []error
	if c.Connect != nil {
		errs = append(errs, c.Connect.Close())
	}
	if c.Broker != nil {
		errs = append(errs, c.Broker.Close())
	}
	if c.Redis != nil {
		errs = append(errs, c.Redis.Close())
	}
	if c.PG != nil {
		errs = append(errs, c.PG.Close())
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("examplesvc: %w", err)
	}
	return nil
}
