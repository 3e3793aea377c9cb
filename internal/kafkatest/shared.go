package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The shared services start lazily, at most once per test binary, so a
// `go test -run Unit` pays nothing for them.
var shared struct {
	mu     sync.Mutex
	active bool // inside Main
	opts   Options

	brokerOnce sync.Once
	broker     *Broker
	brokerErr  error

	connectOnce sync.Once
	connect     *Connect
	connectErr  error
}

// Main runs the tests of a package whose tests call Shared or
// SharedConnect, and stops those services afterwards:
//
//	func TestMain(m *testing.M) { os.Exit(kafkatest.Main(m, kafkatest.Options{})) }
func Main(m *testing.M, opts Options) int {
	return Wrap(m, opts).Run()
}

// Wrap is Main for runners that call Run themselves. It takes anything with
// Run, so it composes with pgtest and goleak; the Kafka services are closed
// when the wrapped Run returns:
//
//	goleak.VerifyTestMain(kafkatest.Wrap(pgtest.Wrap(m, pgopts), opts))
func Wrap(m interface{ Run() int }, opts Options) interface{ Run() int } {
	return mainRunner{m: m, opts: opts}
}

type mainRunner struct {
	m    interface{ Run() int }
	opts Options
}

func (r mainRunner) Run() int {
	shared.mu.Lock()
	shared.active = true
	shared.opts = r.opts
	shared.mu.Unlock()
	code := r.m.Run()
	if err := closeShared(); err != nil {
		fmt.Fprintf(os.Stderr, "kafkatest: closing shared services: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

func closeShared() error {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	shared.active = false
	var errs []error
	// The worker first: it stops its connectors cleanly while the broker
	// can still take their last writes.
	if shared.connect != nil {
		errs = append(errs, shared.connect.Close())
	}
	if shared.broker != nil {
		errs = append(errs, shared.broker.Close())
	}
	return errors.Join(errs...)
}

func requireMain(t testing.TB, what string) {
	t.Helper()
	shared.mu.Lock()
	active := shared.active
	shared.mu.Unlock()
	if !active {
		t.Fatalf("kafkatest: %s needs the package's TestMain to call kafkatest.Main (or kafkatest.Wrap), which stops the shared services when the tests end", what)
	}
}

// sharedContext bounds a shared start: resolving the jars (first run only)
// plus the start itself. Resolve has its own 10-minute budget inside.
func sharedContext() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 15*time.Minute)
}

// Shared returns the test binary's shared broker, starting it on first use
// (or the $KAFKA_BROKERS cluster). Tests share it by using their own topic
// and group names and must not stop or kill it. It fails the test, never
// skips it, when the broker cannot start.
func Shared(t testing.TB) *Broker {
	t.Helper()
	requireMain(t, "Shared")
	shared.brokerOnce.Do(func() {
		ctx, cancel := sharedContext()
		defer cancel()
		shared.mu.Lock()
		opts := shared.opts
		shared.mu.Unlock()
		b, err := Start(ctx, opts)
		shared.mu.Lock()
		shared.broker, shared.brokerErr = b, err
		shared.mu.Unlock()
	})
	shared.mu.Lock()
	b, err := shared.broker, shared.brokerErr
	shared.mu.Unlock()
	if err != nil {
		t.Fatalf("kafkatest: the shared Kafka broker could not start: %v", err)
	}
	return b
}

// SharedConnect returns the test binary's shared Connect worker, attached to
// the shared broker, starting both on first use. Tests share it by giving
// their connectors their own names (NewPostgresConnector does).
func SharedConnect(t testing.TB) *Connect {
	t.Helper()
	requireMain(t, "SharedConnect")
	b := Shared(t)
	shared.connectOnce.Do(func() {
		ctx, cancel := sharedContext()
		defer cancel()
		shared.mu.Lock()
		opts := shared.opts
		shared.mu.Unlock()
		copts := opts.Connect
		if copts.Logf == nil {
			copts.Logf = opts.Logf
		}
		c, err := StartConnect(ctx, b.Brokers(), copts)
		shared.mu.Lock()
		shared.connect, shared.connectErr = c, err
		shared.mu.Unlock()
	})
	shared.mu.Lock()
	c, err := shared.connect, shared.connectErr
	shared.mu.Unlock()
	if err != nil {
		t.Fatalf("kafkatest: the shared Kafka Connect worker could not start: %v", err)
	}
	return c
}

var nameCounter atomic.Int64

// Name returns a topic, group or connector name unique in this test binary
// and readable in logs: the test's name, sanitized, and a counter.
func Name(t testing.TB) string {
	var b strings.Builder
	for _, r := range strings.ToLower(t.Name()) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			b.WriteRune(r)
		} else if b.Len() > 0 && !strings.HasSuffix(b.String(), "_") {
			b.WriteByte('_')
		}
		if b.Len() >= 40 {
			break
		}
	}
	return fmt.Sprintf("%s_%d_%d", strings.TrimRight(b.String(), "_"), os.Getpid()%100000, nameCounter.Add(1))
}

// NewPostgresConnector starts a Debezium PostgreSQL connector named after
// the test (see Name) on c, waits until it streams, and deletes it, its
// slot and its publication when the test ends (before the test's database
// is dropped, if pgtest.NewDatabase was called earlier in the test).
func NewPostgresConnector(t testing.TB, c *Connect, d DebeziumPostgres) *PostgresConnector {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pc, err := c.StartPostgresConnector(ctx, Name(t), d)
	if err != nil {
		t.Fatalf("kafkatest: NewPostgresConnector: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := pc.Delete(ctx); err != nil {
			t.Errorf("kafkatest: deleting connector %s: %v", pc.Name, err)
		}
	})
	return pc
}
