package pgtest

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

	"github.com/jackc/pgx/v5"
)

// The shared services are started lazily, at most once per test binary, so
// a `go test -run Unit` pays nothing for them.
var shared struct {
	mu     sync.Mutex
	active bool // inside Main
	opts   Options

	clusterOnce sync.Once
	cluster     *Cluster
	clusterErr  error

	redisOnce sync.Once
	redis     *Redis
	redisErr  error
}

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
	return mainRunner{m: m, opts: opts}
}

type mainRunner struct {
	m    *testing.M
	opts Options
}

func (r mainRunner) Run() int {
	shared.mu.Lock()
	shared.active = true
	shared.opts = r.opts
	shared.mu.Unlock()
	code := r.m.Run()
	if err := closeShared(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: closing shared services: %v\n", err)
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
	if shared.cluster != nil {
		errs = append(errs, shared.cluster.Close())
	}
	if shared.redis != nil {
		errs = append(errs, shared.redis.Close())
	}
	return errors.Join(errs...)
}

func requireMain(t testing.TB, what string) {
	t.Helper()
	shared.mu.Lock()
	active := shared.active
	shared.mu.Unlock()
	if !active {
		t.Fatalf("pgtest: %s needs the package's TestMain to call pgtest.Main (or pgtest.Wrap), which stops the shared services when the tests end", what)
	}
}

// Shared returns the test binary's shared cluster, starting it on first use.
// Tests share it by using their own database (NewDatabase) and must not
// stop, kill or promote its nodes. It fails the test, never skips it, when
// the cluster cannot start.
func Shared(t testing.TB) *Cluster {
	t.Helper()
	requireMain(t, "Shared")
	shared.clusterOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		c, err := Start(ctx, shared.opts)
		shared.mu.Lock()
		shared.cluster, shared.clusterErr = c, err
		shared.mu.Unlock()
	})
	shared.mu.Lock()
	c, err := shared.cluster, shared.clusterErr
	shared.mu.Unlock()
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
	requireMain(t, "SharedRedis")
	shared.redisOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r, err := StartRedis(ctx)
		shared.mu.Lock()
		shared.redis, shared.redisErr = r, err
		shared.mu.Unlock()
	})
	shared.mu.Lock()
	r, err := shared.redis, shared.redisErr
	shared.mu.Unlock()
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
	name := fmt.Sprintf("%s_%d", sanitizeName(t.Name()), dbCounter.Add(1))
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

// sanitizeName turns a test name into a short lower-case identifier; the
// counter appended by NewDatabase keeps it unique.
func sanitizeName(s string) string {
	var b strings.Builder
	b.WriteString("t_")
	underscore := true
	for _, r := range strings.ToLower(s) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
			underscore = false
		case !underscore:
			b.WriteByte('_')
			underscore = true
		}
		if b.Len() >= 40 {
			break
		}
	}
	return strings.TrimRight(b.String(), "_")
}
