package consume

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/replicapool"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// A replica pool that reaches more than one server: what the tracker saw
// on its connection says nothing about the handler's, so every routed
// acquire is checked against the job's position (package replicapool).
// Each test pauses one standby and counts stale reads (a job's own row
// missing where it read), which must be none.

// balancedEnv is a private cluster of two standbys behind one endpoint.
type balancedEnv struct {
	*env
	c      *pgtest.Cluster
	lb     *pgxpool.Pool
	reader *sdkmetric.ManualReader
	r      *Router
}

// newBalanced starts a private cluster, the endpoint dsn returns for it,
// and a router whose one replica pool is that endpoint.
func newBalanced(t *testing.T, dsn func(c *pgtest.Cluster, db string) string) *balancedEnv {
	t.Helper()
	c := privateCluster(t)
	e := setup(t, c)
	return newBalancedOn(t, c, e, dsn(c, e.db))
}

// newBalancedOn is newBalanced on e's database of c, through endpoint (a
// DSN whose database is e's).
func newBalancedOn(t *testing.T, c *pgtest.Cluster, e *env, endpoint string) *balancedEnv {
	t.Helper()
	b := &balancedEnv{env: e, c: c, reader: sdkmetric.NewManualReader()}
	var err error
	b.lb, err = pgxpool.New(ctxT(t), endpoint)
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

// haproxyDSN is the DSN of database db through h.
func haproxyDSN(h *proxytest.HAProxy, db string) string {
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", h.Addr(), db)
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

// pause pauses n's replay until the test ends.
func pause(t testing.TB, n *pgtest.Node) {
	t.Helper()
	require.NoError(t, n.PauseReplay(ctxT(t)))
	t.Cleanup(func() { _ = n.ResumeReplay(context.Background()) })
}

// readStats is what reads found.
type readStats struct {
	jobs, onReplica, rerouted int
}

// reads routes n jobs, each after a write of its own, from workers
// goroutines at once, and reads each job's row where the router sends it.
// A job whose read fails because the replica failed it (ReplicaFailed) is
// routed and read again, as an adapter does, without counting an
// attempt; a deferred job is routed again after a pause. It fails the test
// on a stale read or any other error.
func (b *balancedEnv) reads(t *testing.T, n, workers int, policy Policy) readStats {
	t.Helper()
	ctx := ctxT(t)
	var mu sync.Mutex
	var st readStats
	one := func() error {
		var id int64
		if err := b.primary.QueryRow(ctx, "INSERT INTO items (v) VALUES ('x') RETURNING id").Scan(&id); err != nil {
			return err
		}
		tok := capture(t, b.primary, "main")
		for range 50 {
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
				if !ReplicaFailed(h) {
					return err
				}
				mu.Lock()
				st.rerouted++
				mu.Unlock()
				continue
			}
			if !ok {
				return fmt.Errorf("stale read: decided %s/%s on %q", d.Outcome, d.Reason, d.Databases[0].Replica)
			}
			mu.Lock()
			st.jobs++
			if d.Databases[0].Replica != "" {
				st.onReplica++
			}
			mu.Unlock()
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
	return st
}

func (b *balancedEnv) connections(t *testing.T) map[string]int64 {
	got := map[string]int64{}
	for set, n := range sums(t, b.reader)["caughtup.consume.replica.connections"] {
		got[set] = n
	}
	return got
}

// resetHandlers drops every connection of the router's handler pools, as
// a balancer whose choice moved would meet them: new ones follow it.
func (b *balancedEnv) resetHandlers() {
	for _, ps := range b.r.handlers {
		for _, p := range ps {
			p.Handlers().Reset()
		}
	}
}

const behindSet = "caughtup.result=behind,db.system.name=postgresql"

// TestHAProxyRoundRobin: HAProxy balances each new connection over two
// standbys, one of them paused. 1,000 routed reads, none stale; the ones
// on a replica are served by the server the tracker watches or by one the
// check found caught up.
func TestHAProxyRoundRobin(t *testing.T) {
	t.Parallel()
	b := newBalanced(t, func(c *pgtest.Cluster, db string) string {
		// Connections live briefly, so that the handlers' pool keeps
		// reconnecting through the balancer and reaches both standbys.
		return haproxyDSN(proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)}), db) + "&pool_max_conn_lifetime=100ms"
	})
	_, other := b.watched(t)
	pause(t, other)
	st := b.reads(t, 1000, 8, Delayed)
	conns := b.connections(t)
	t.Logf("1000 reads: %d on a replica, %d routed again; connection checks %v", st.onReplica, st.rerouted, conns)
	require.Positive(t, st.onReplica)
	require.Positive(t, conns[behindSet], "connections to the paused standby were given back")
}

// TestBalancedOffloadsWhileTheWatchedOneIsBehind (issue 36 1b): the
// balancer alternates between two standbys from the start, and the one
// the tracker's connection reached is paused. The other one has every
// token; jobs must go to it (≥ 90 %), none stale. Then the same with the
// other standby paused.
func TestBalancedOffloadsWhileTheWatchedOneIsBehind(t *testing.T) {
	t.Parallel()
	for _, pauseWatched := range []bool{true, false} {
		t.Run(fmt.Sprintf("watched paused %v", pauseWatched), func(t *testing.T) {
			t.Parallel()
			b := newBalanced(t, func(c *pgtest.Cluster, db string) string {
				return haproxyDSN(proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)}), db)
			})
			watched, other := b.watched(t)
			if pauseWatched {
				pause(t, watched)
			} else {
				pause(t, other)
			}
			const n = 200
			st := b.reads(t, n, 4, Delayed)
			t.Logf("%d reads: %d on a replica, %d routed again; connection checks %v", n, st.onReplica, st.rerouted, b.connections(t))
			require.GreaterOrEqual(t, st.onReplica, n*9/10, "a caught-up server behind the endpoint serves ≥ 90%% of the reads")
		})
	}
}

// TestBalancerChoiceMoves: the balancer sends every new connection to the
// paused standby from some moment on (a Service's endpoints change, a DNS
// name moves) while the tracker's connection stays on the other one.
// Reads never go stale; those that cannot be served are routed again,
// and end on the primary.
func TestBalancerChoiceMoves(t *testing.T) {
	t.Parallel()
	var h *proxytest.HAProxy
	b := newBalanced(t, func(c *pgtest.Cluster, db string) string {
		h = proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
		return haproxyDSN(h, db)
	})
	watched, other := b.watched(t)
	_ = b.reads(t, 50, 4, Delayed)
	pause(t, other)
	for i, n := range b.c.Replicas() {
		if n == watched {
			require.NoError(t, h.SetState(h.Server(i), proxytest.Maint)) // new connections: the paused one only
		}
	}
	b.resetHandlers()
	st := b.reads(t, 200, 4, Delayed)
	t.Logf("200 reads after the move: %d on a replica, %d routed again; connection checks %v", st.onReplica, st.rerouted, b.connections(t))
	require.Equal(t, 200, st.jobs)
}

// TestPgBouncerOneStandby: PgBouncer in transaction pooling in front of
// one standby. Every routed read is checked in its transaction (the
// router cannot know that the pooler reaches one server); all are served
// by the standby, none stale.
func TestPgBouncerOneStandby(t *testing.T) {
	t.Parallel()
	b := newBalanced(t, func(c *pgtest.Cluster, db string) string {
		return proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(c.Replicas()[0])}).DSN(db)
	})
	st := b.reads(t, 200, 4, Delayed)
	require.Equal(t, 200, st.onReplica)
	require.Zero(t, st.rerouted)
	conns := b.connections(t)
	require.Zero(t, conns[behindSet])
	require.Positive(t, conns["caughtup.result=in_transaction,db.system.name=postgresql"])
	require.Equal(t, replicapool.TopologyPooled, b.r.handlers["main"][0].Topology())
	t.Logf("200 reads through PgBouncer over one standby: %d on the replica; connection checks %v", st.onReplica, conns)
}

// pooledOverBalancer is PgBouncer with one database entry, pointing at
// HAProxy over both standbys, and the HAProxy.
func pooledOverBalancer(t *testing.T, c *pgtest.Cluster, mode string) (*proxytest.PgBouncer, *proxytest.HAProxy) {
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
	bo := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: []string{h.Addr()}, PoolMode: mode})
	return bo, h
}

// TestPgBouncerTransactionPoolingOverWeightedBalancer (issue 36 §1): the
// set-up a start-up sample cannot see through. PgBouncer in transaction
// pooling, one database entry pointing at HAProxy over both standbys with
// weights 9:1 and 99:1 (and plain round robin); the lightly weighted
// standby paused; pgx in the simple protocol, as PgBouncer needs; another
// client running short transactions through the same PgBouncer database
// all along. 1,000 reads each: none stale.
func TestPgBouncerTransactionPoolingOverWeightedBalancer(t *testing.T) {
	t.Parallel()
	for _, w := range []int{9, 99, 1} {
		t.Run(fmt.Sprintf("weights %d:1", w), func(t *testing.T) {
			t.Parallel()
			c := privateCluster(t)
			e := setup(t, c)
			bo, h := pooledOverBalancer(t, c, "transaction")
			require.NoError(t, h.SetWeight(h.Server(0), w))
			require.NoError(t, h.SetWeight(h.Server(1), 1))
			pause(t, c.Replicas()[1])
			b := newBalancedOn(t, c, e, bo.DSN(e.db)+"&default_query_exec_mode=simple_protocol")

			// The other client: short transactions on the same PgBouncer
			// database, so that server connections change hands all along.
			ctx, stop := context.WithCancel(ctxT(t))
			var others atomic.Int64
			var g errgroup.Group
			other, err := pgxpool.New(ctx, bo.DSN(e.db)+"&default_query_exec_mode=simple_protocol")
			require.NoError(t, err)
			t.Cleanup(other.Close)
			for range 2 {
				g.Go(func() error {
					for ctx.Err() == nil {
						tx, err := other.Begin(ctx)
						if err != nil {
							return nil
						}
						_, _ = tx.Exec(ctx, "SELECT pg_backend_pid()")
						_ = tx.Rollback(ctx)
						others.Add(1)
					}
					return nil
				})
			}
			st := b.reads(t, 1000, 4, Delayed)
			stop()
			require.NoError(t, g.Wait())
			conns := b.connections(t)
			t.Logf("1000 reads through PgBouncer (transaction pooling) over HAProxy %d:1, standby 2 paused, beside %d other transactions: %d on a replica, %d routed again; connection checks %v",
				w, others.Load(), st.onReplica, st.rerouted, conns)
			require.Equal(t, 1000, st.jobs)
			require.Positive(t, conns["caughtup.result=in_transaction,db.system.name=postgresql"])
			require.Zero(t, conns["caughtup.result=same_server,db.system.name=postgresql"], "no connection through a pooler is trusted without a check")
		})
	}
}

// TestPgBouncerSessionPoolingOverBalancer (issue 36 1b): PgBouncer in
// session pooling over HAProxy round robin over both standbys, one paused:
// the other serves ≥ 90 % of the reads, none stale, in each of 5 runs.
func TestPgBouncerSessionPoolingOverBalancer(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	envs := make([]*env, 5)
	for i := range envs {
		envs[i] = setup(t, c) // before the pause: setup waits for the replicas
	}
	pause(t, c.Replicas()[1])
	for run, e := range envs {
		bo, _ := pooledOverBalancer(t, c, "session")
		b := newBalancedOn(t, c, e, bo.DSN(e.db))
		const n = 100
		st := b.reads(t, n, 4, Delayed)
		t.Logf("run %d: %d reads through PgBouncer (session pooling) over HAProxy, one standby paused: %d on a replica, %d routed again; connection checks %v",
			run+1, n, st.onReplica, st.rerouted, b.connections(t))
		require.GreaterOrEqual(t, st.onReplica, n*9/10)
	}
}

// TestReplicaFailedRoutesElsewhere (issue 36 §2): the tracker calls a
// replica healthy (its own connection was made before), but new
// connections to it are reset. A handler that meets that learns it
// through ReplicaFailed; the replica is left out, and the job routed
// again reads elsewhere, never stale.
func TestReplicaFailedRoutesElsewhere(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	e := setup(t, c)
	proxy, err := fault.NewProxy(proxytest.Addrs(c.Replicas()[0])[0])
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	far, err := pgxpool.New(ctxT(t), fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", proxy.Addr(), e.db))
	require.NoError(t, err)
	t.Cleanup(far.Close)
	r := e.router(t, func(cfg *Config) {
		cfg.Databases = map[string]replay.Database{"main": {Primary: e.primary, Replicas: []replay.Replica{{Name: "far", Pool: far}}}}
		cfg.PrimaryRate = rate.Inf
	})
	id, tok := e.write(t)
	seen(t, r, tok)
	proxy.Refuse()

	h, d, err := r.Route(ctxT(t), Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, "far", d.Databases[0].Replica, "the tracker still calls it caught up")
	_, err = readRow(h, DB(h, "main"), id)
	require.Error(t, err)
	require.True(t, ReplicaFailed(h), "the handler's failure is the replica's: %v", err)

	h, d, err = r.Route(ctxT(t), Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimary, d.Outcome, "the replica is left out")
	require.False(t, ReplicaFailed(h))
	ok, err := readRow(h, DB(h, "main"), id)
	require.NoError(t, err)
	require.True(t, ok)
	require.ErrorIs(t, r.Snapshot().Database("main").Replicas[0].Err, ErrUnreachable)
	require.NoError(t, r.Tracker().Snapshot().Database("main").Replicas[0].Err, "the tracker's own connection still works")
}
