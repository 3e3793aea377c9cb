package consume

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// A replica pool that reaches more than one server: what the tracker saw
// on its connection says nothing about the handler's, so every routed
// acquire is checked against the server the decision judged.

// balancedEnv is a private cluster of two standbys behind one endpoint.
type balancedEnv struct {
	*env
	c      *pgtest.Cluster
	lb     *pgxpool.Pool
	reader *sdkmetric.ManualReader
	r      *Router
}

func newBalanced(t *testing.T, dsn func(c *pgtest.Cluster, db string) string) *balancedEnv {
	t.Helper()
	c := privateCluster(t)
	e := setup(t, c)
	b := &balancedEnv{env: e, c: c, reader: sdkmetric.NewManualReader()}
	var err error
	b.lb, err = pgxpool.New(ctxT(t), dsn(c, e.db))
	require.NoError(t, err)
	t.Cleanup(b.lb.Close)
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(b.reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	b.r = e.router(t, func(cfg *Config) {
		cfg.Databases = map[string]replay.Database{"main": {Primary: e.primary, Replicas: []replay.Replica{{Name: "lb", Pool: b.lb}}}}
		cfg.MeterProvider = mp
		cfg.WaitBudget = 50 * time.Millisecond
		cfg.PrimaryRate = rate.Inf // what is measured is where reads go, not the cap
	})
	return b
}

// watched is the standby whose server the tracker's connection reached.
func (b *balancedEnv) watched(t testing.TB) (watched, other *pgtest.Node) {
	t.Helper()
	run := waitUntil(t, b.r, "the tracker knows the server", func(s *replay.Snapshot) bool {
		return !s.Database("main").Replicas[0].Incarnation.IsZero()
	}).Database("main").Replicas[0].Incarnation
	for _, n := range b.c.Replicas() {
		p, err := n.Pool(ctxT(t), b.db)
		require.NoError(t, err)
		var start time.Time
		require.NoError(t, p.QueryRow(ctxT(t), "SELECT pg_postmaster_start_time()").Scan(&start))
		p.Close()
		if start.Equal(run.PostmasterStart) {
			watched = n
		} else {
			other = n
		}
	}
	require.NotNil(t, watched)
	require.NotNil(t, other)
	return watched, other
}

// reads routes n jobs, each after a write of its own, from workers
// goroutines at once, and reads each job's row where the router sends it;
// a job whose read fails is routed and read again, as a queue would retry
// it. It returns the reads made on a replica and the failed attempts, and
// fails the test on a stale read.
func (b *balancedEnv) reads(t *testing.T, n, workers int, policy Policy) (replicaReads, failed int) {
	t.Helper()
	ctx := ctxT(t)
	var mu sync.Mutex
	one := func() error {
		var id int64
		if err := b.primary.QueryRow(ctx, "INSERT INTO items (v) VALUES ('x') RETURNING id").Scan(&id); err != nil {
			return err
		}
		tok := capture(t, b.primary, "main")
		for attempt := 0; attempt < 20; attempt++ {
			h, d, err := b.r.Route(ctx, Job{Token: tok, Policy: policy})
			var de *DeferError
			if errors.As(err, &de) {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			if err != nil {
				return err
			}
			ok, err := readRow(h, DB(h, "main"), id)
			if err != nil {
				if !errors.Is(err, ErrReplicaBehind) {
					return err
				}
				mu.Lock()
				failed++
				mu.Unlock()
				continue
			}
			if !ok {
				return fmt.Errorf("stale read: decided %s/%s on %q", d.Outcome, d.Reason, d.Databases[0].Replica)
			}
			if d.Databases[0].Replica != "" {
				mu.Lock()
				replicaReads++
				mu.Unlock()
			}
			return nil
		}
		return errors.New("the job never read")
	}
	var g errgroup.Group
	for w := range workers {
		g.Go(func() error {
			for i := w; i < n; i += workers {
				if err := one(); err != nil {
					return err
				}
			}
			return nil
		})
	}
	require.NoError(t, g.Wait())
	return replicaReads, failed
}

func (b *balancedEnv) connections(t *testing.T) map[string]int64 {
	got := map[string]int64{}
	for set, n := range sums(t, b.reader)["caughtup.consume.replica.connections"] {
		got[set] = n
	}
	return got
}

// TestHAProxyRoundRobin: HAProxy balances each new connection over two
// standbys, one of them paused. 1,000 routed reads, none stale; the ones
// on a replica are served by the server the tracker watches or by one the
// check found caught up.
func TestHAProxyRoundRobin(t *testing.T) {
	t.Parallel()
	var h *proxytest.HAProxy
	b := newBalanced(t, func(c *pgtest.Cluster, db string) string {
		h = proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
		return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", h.Addr(), db)
	})
	_, other := b.watched(t)
	require.NoError(t, other.PauseReplay(ctxT(t)))
	t.Cleanup(func() { _ = other.ResumeReplay(context.Background()) })
	replicaReads, failed := b.reads(t, 1000, 8, Delayed)
	conns := b.connections(t)
	t.Logf("1000 reads: %d on a replica, %d attempts failed and retried; connection checks %v", replicaReads, failed, conns)
	require.Positive(t, replicaReads)
	require.Positive(t, conns["caughtup.result=behind,db.system.name=postgresql"], "connections to the paused standby were dropped")
}

// TestBalancerChoiceMoves: the balancer sends every new connection to the
// paused standby from some moment on (a Service's endpoints change, a DNS
// name moves) while the tracker's connection stays on the other one.
// Reads never go stale; those that cannot be served fail and are retried.
func TestBalancerChoiceMoves(t *testing.T) {
	t.Parallel()
	var h *proxytest.HAProxy
	b := newBalanced(t, func(c *pgtest.Cluster, db string) string {
		h = proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
		return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", h.Addr(), db)
	})
	watched, other := b.watched(t)
	_, _ = b.reads(t, 50, 4, Delayed)
	require.NoError(t, other.PauseReplay(ctxT(t)))
	t.Cleanup(func() { _ = other.ResumeReplay(context.Background()) })
	for i, n := range b.c.Replicas() {
		if n == watched {
			require.NoError(t, h.SetState(h.Server(i), proxytest.Maint)) // new connections: the paused one only
		}
	}
	b.lb.Reset() // the handlers' pool is the router's, but it was built from this config: reconnect it too
	for _, p := range b.r.owned {
		p.Reset()
	}
	replicaReads, failed := b.reads(t, 200, 4, Delayed)
	t.Logf("200 reads after the move: %d on a replica, %d attempts failed; connection checks %v", replicaReads, failed, b.connections(t))
}

// TestPgBouncerOneStandby: PgBouncer in transaction pooling in front of
// one standby is one server: the router uses it as a direct pool, with no
// query per job.
func TestPgBouncerOneStandby(t *testing.T) {
	t.Parallel()
	b := newBalanced(t, func(c *pgtest.Cluster, db string) string {
		return proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(c.Replicas()[0])}).DSN(db)
	})
	replicaReads, failed := b.reads(t, 200, 4, Delayed)
	require.Positive(t, replicaReads)
	require.Zero(t, failed)
	conns := b.connections(t)
	require.Zero(t, conns["caughtup.result=behind,db.system.name=postgresql"])
	t.Logf("200 reads through PgBouncer over one standby: %d on the replica; connection checks %v", replicaReads, conns)
}

// TestPgBouncerTwoStandbys: PgBouncer in transaction pooling over two
// standbys hands one client connection's transactions to either: no check
// can tie a read to a server, and NewRouter refuses the pool, saying so.
func TestPgBouncerTwoStandbys(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	e := setup(t, c)
	bo := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(c.Replicas()...), PoolSize: 2})
	lb, err := pgxpool.New(ctxT(t), bo.DSN(e.db))
	require.NoError(t, err)
	t.Cleanup(lb.Close)
	var refused error
	for range 5 { // the pooler's first server connections may all go to one standby
		_, refused = NewRouter(ctxT(t), e.config(t, func(cfg *Config) {
			cfg.Databases = map[string]replay.Database{"main": {Primary: e.primary, Replicas: []replay.Replica{{Name: "pgbouncer", Pool: lb}}}}
		}))
		if refused != nil {
			break
		}
	}
	require.ErrorIs(t, refused, ErrMultiplexedReplica)
	require.ErrorContains(t, refused, `"pgbouncer"`)
	t.Log(refused)
}
