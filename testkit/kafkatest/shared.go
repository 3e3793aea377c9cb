package kafkatest

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// The shared services start lazily, at most once per test binary, so a
// `go test -run Unit` pays nothing for them. Main closes the worker first:
// it stops its connectors cleanly while the broker can still take their
// last writes.
var (
	shared        = testsvc.NewShared[Options]("kafkatest")
	sharedConnect = testsvc.NewService[*Connect](shared)
	sharedBroker  = testsvc.NewService[*Broker](shared)
)

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
	return shared.Wrap(m, opts)
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
	shared.Require(t, "Shared")
	b, err := sharedBroker.Get(func() (*Broker, error) {
		ctx, cancel := sharedContext()
		defer cancel()
		return Start(ctx, shared.Options())
	})
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
	shared.Require(t, "SharedConnect")
	b := Shared(t)
	c, err := sharedConnect.Get(func() (*Connect, error) {
		ctx, cancel := sharedContext()
		defer cancel()
		opts := shared.Options()
		copts := opts.Connect
		if copts.Logf == nil {
			copts.Logf = opts.Logf
		}
		return StartConnect(ctx, b.Brokers(), copts)
	})
	if err != nil {
		t.Fatalf("kafkatest: the shared Kafka Connect worker could not start: %v", err)
	}
	return c
}

var nameCounter atomic.Int64

// Name returns a topic, group or connector name unique in this test binary
// and readable in logs: the test's name, sanitized, and a counter.
func Name(t testing.TB) string {
	return fmt.Sprintf("%s_%d_%d", testsvc.SanitizeName("", t.Name()), os.Getpid()%100000, nameCounter.Add(1))
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
