package pgtest

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// The shared services are started lazily, at most once per test binary, so
// a `go test -run Unit` pays nothing for them. Main closes the cluster
// first, then redis-server.
var (
	shared        = testsvc.NewShared[Options]("pgtest")
	sharedCluster = testsvc.NewService[*Cluster](shared)
	sharedRedis   = testsvc.NewService[*Redis](shared)
)

// Main runs the tests of a package whose integration tests call Shared or
// SharedRedis, and stops those services afterwards. Use it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, pgtest.Options{})) }
func Main(m *testing.M, opts Options) int {
	return Wrap(m, opts).Run()
}

// Wrap is Main for runners that call Run themselves, such as
// goleak.VerifyTestMain(pgtest.Wrap(m, opts)): the shared services are closed
// before goleak looks for leftover goroutines.
func Wrap(m *testing.M, opts Options) interface{ Run() int } {
	return shared.Wrap(m, opts)
}

// Shared returns the test binary's shared cluster, starting it on first use.
// Tests share it by using their own database (NewDatabase) and must not
// stop, kill or promote its nodes. It fails the test, never skips it, when
// the cluster cannot start.
func Shared(t testing.TB) *Cluster {
	t.Helper()
	shared.Require(t, "Shared")
	c, err := sharedCluster.Get(func() (*Cluster, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		return Start(ctx, shared.Options())
	})
	if err != nil {
		t.Fatalf("pgtest: the shared PostgreSQL cluster could not start: %v", err)
	}
	if c == nil || c.isClosed() {
		t.Fatal("pgtest: the shared PostgreSQL cluster is closed")
	}
	return c
}

// SharedRedis returns the test binary's shared redis-server, starting it on
// first use. Tests share it; isolate by key prefix or database number.
func SharedRedis(t testing.TB) *Redis {
	t.Helper()
	shared.Require(t, "SharedRedis")
	r, err := sharedRedis.Get(func() (*Redis, error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return StartRedis(ctx)
	})
	if err != nil {
		t.Fatalf("pgtest: the shared redis-server could not start: %v", err)
	}
	return r
}

var dbCounter atomic.Int64

// NewDatabase creates a database named after the test, waits until every
// running replica has it and drops it (WITH (FORCE)) when the test ends.
func NewDatabase(t testing.TB, c *Cluster) string {
	t.Helper()
	// The counter keeps the name unique; the sanitized test name keeps it
	// readable and well under PostgreSQL's 63-byte limit.
	name := fmt.Sprintf("%s_%d", testsvc.SanitizeName("t_", t.Name()), dbCounter.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.CreateDatabase(ctx, name); err != nil {
		t.Fatalf("pgtest: NewDatabase: %v", err)
	}
	t.Cleanup(func() {
		p := c.Primary()
		if c.isClosed() || !p.Running() {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := p.Exec(ctx, "", "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Logf("pgtest: dropping %s: %v", name, err)
		}
	})
	return name
}
