package replicapool

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// targetKey carries a test's Target, as a router's routed context does.
type targetKey struct{}

func routed(ctx context.Context, t Target) context.Context {
	return context.WithValue(ctx, targetKey{}, t)
}

// events counts what a pool reports.
type events struct {
	mu         sync.Mutex
	checks     [NumChecks]int
	excluded   []Reason
	readmitted int
}

func (e *events) Checked(_ context.Context, c Check) { e.mu.Lock(); e.checks[c]++; e.mu.Unlock() }
func (e *events) Excluded(r Reason, _ error) {
	e.mu.Lock()
	e.excluded = append(e.excluded, r)
	e.mu.Unlock()
}
func (e *events) Readmitted() { e.mu.Lock(); e.readmitted++; e.mu.Unlock() }

func (e *events) count(c Check) int { e.mu.Lock(); defer e.mu.Unlock(); return e.checks[c] }

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// fixture is a database on a cluster with a table, and the primary.
type fixture struct {
	c       *pgtest.Cluster
	db      string
	primary *pgxpool.Pool
}

func newFixture(t *testing.T, c *pgtest.Cluster) *fixture {
	t.Helper()
	f := &fixture{c: c, db: pgtest.NewDatabase(t, c)}
	var err error
	f.primary, err = c.Primary().Pool(ctxT(t), f.db)
	require.NoError(t, err)
	t.Cleanup(f.primary.Close)
	_, err = f.primary.Exec(ctxT(t), "CREATE TABLE items (id bigserial PRIMARY KEY)")
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctxT(t)))
	return f
}

// write inserts a row and returns its id and the position a producer
// stamps: the primary's insert position after COMMIT.
func (f *fixture) write(t testing.TB) (int64, position.Entry) {
	t.Helper()
	var id int64
	require.NoError(t, f.primary.QueryRow(ctxT(t), "INSERT INTO items DEFAULT VALUES RETURNING id").Scan(&id))
	p, err := pgwal.ReadPrimary(ctxT(t), f.primary, pgwal.Control)
	require.NoError(t, err)
	return id, position.Entry{Database: "main", Epoch: p.Epoch(), LSN: p.InsertEnd(), Source: position.SourcePrimary}
}

// pool is a Pool over template whose routed acquires take their Target
// from the context.
func (f *fixture) pool(t *testing.T, template *pgxpool.Pool, ev *events) *Pool {
	t.Helper()
	p, err := New(template, Config{
		Database: "main", Replica: "r",
		Target: func(ctx context.Context) (Target, bool) {
			tg, ok := ctx.Value(targetKey{}).(Target)
			return tg, ok
		},
		Primary: func() *replay.PrimaryState { return &replay.PrimaryState{HistoryKnown: true} },
		Events:  ev,
	})
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

func found(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, id int64) (bool, error) {
	var n int
	err := q.QueryRow(ctx, "SELECT count(*) FROM items WHERE id = $1", id).Scan(&n)
	return n == 1, err
}

// Through PgBouncer in transaction pooling over HAProxy over both
// standbys, one paused: every routed read runs in the transaction its
// check opened, on a server that has the row, and the connection goes
// back to the pool idle, its transaction ended.
func TestPooledReadRunsInItsCheckedTransaction(t *testing.T) {
	t.Parallel()
	c, err := pgtest.Start(ctxT(t), pgtest.Options{Replicas: 2, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	f := newFixture(t, c)
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
	bo := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: []string{h.Addr()}, PoolSize: 4})
	template, err := pgxpool.New(ctxT(t), bo.DSN(f.db)+"&default_query_exec_mode=simple_protocol")
	require.NoError(t, err)
	t.Cleanup(template.Close)
	ev := &events{}
	p := f.pool(t, template, ev)
	require.NoError(t, c.Replicas()[1].PauseReplay(ctxT(t)))
	t.Cleanup(func() { _ = c.Replicas()[1].ResumeReplay(context.Background()) })

	var failed int
	for range 200 {
		id, need := f.write(t)
		var a Attempt
		ctx := routed(ctxT(t), Target{Need: need, Attempt: &a})
		ok, err := found(ctx, p.Handlers(), id)
		if errors.Is(err, ErrReplicaBehind) {
			require.True(t, a.Failed())
			failed++
			continue
		}
		require.NoError(t, err)
		require.True(t, ok, "stale read")
	}
	require.Less(t, failed, 20)
	require.Equal(t, TopologyPooled, p.Topology())
	require.Positive(t, ev.count(CheckInTransaction))
	require.Zero(t, ev.count(CheckSameServer), "a pooled connection is never trusted unchecked")
	st := p.Handlers().Stat()
	require.LessOrEqual(t, st.TotalConns(), int32(8), "released connections are kept, not destroyed with an open transaction")

	// A handler's own transaction runs inside the checked one (PostgreSQL
	// warns of a nested BEGIN), and a statement after its COMMIT is
	// checked again, in a new transaction.
	id, need := f.write(t)
	r0, err := c.Replicas()[0].Pool(ctxT(t), f.db)
	require.NoError(t, err)
	defer r0.Close()
	require.Eventually(t, func() bool { ok, _ := found(ctxT(t), r0, id); return ok }, time.Minute, 5*time.Millisecond)
	for attempt := 0; ; attempt++ {
		require.Less(t, attempt, 20, "no connection reached the caught-up standby")
		ctx := routed(ctxT(t), Target{Need: need, Attempt: &Attempt{}})
		conn, err := p.Handlers().Acquire(ctx)
		if errors.Is(err, ErrReplicaBehind) {
			continue
		}
		require.NoError(t, err)
		func() {
			defer conn.Release()
			require.Equal(t, byte('T'), conn.Conn().PgConn().TxStatus(), "the check's transaction is open")
			tx, err := conn.Begin(ctx)
			require.NoError(t, err)
			ok, err := found(ctx, tx, id)
			require.NoError(t, err)
			require.True(t, ok)
			require.NoError(t, tx.Commit(ctx))
			require.Equal(t, byte('I'), conn.Conn().PgConn().TxStatus())
			before := ev.count(CheckInTransaction)
			ok, err = found(ctx, conn, id)
			if err == nil {
				require.True(t, ok, "stale read after the handler's commit")
				require.Equal(t, before+1, ev.count(CheckInTransaction), "checked again")
				require.Equal(t, byte('T'), conn.Conn().PgConn().TxStatus())
			} else {
				require.True(t, conn.Conn().IsClosed(), "a connection found behind is closed, not read: %v", err)
			}
		}()
		break
	}
}

// A direct connection through a balancer: free on a server the table
// knows has replayed the job's position, one query on another; one
// behind is given back, and after MaxRefusals the acquire fails and the
// job's attempt says so.
func TestDirectConnectionChecks(t *testing.T) {
	t.Parallel()
	c, err := pgtest.Start(ctxT(t), pgtest.Options{Replicas: 2, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	f := newFixture(t, c)
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
	template, err := pgxpool.New(ctxT(t), fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", h.Addr(), f.db))
	require.NoError(t, err)
	t.Cleanup(template.Close)
	ev := &events{}
	p := f.pool(t, template, ev)

	id, need := f.write(t)
	require.NoError(t, c.WaitReplicasCaughtUp(ctxT(t)))
	// Reads at once, so that the pool opens several connections, which
	// the balancer spreads over both standbys.
	var g errgroup.Group
	for range 8 {
		g.Go(func() error {
			for range 5 {
				ok, err := found(routed(ctxT(t), Target{Need: need, Attempt: &Attempt{}}), p.Handlers(), id)
				if err != nil || !ok {
					return fmt.Errorf("read: found %v, %v", ok, err)
				}
			}
			return nil
		})
	}
	require.NoError(t, g.Wait())
	require.Positive(t, ev.count(CheckSameServer), "servers seen at connect past the position cost nothing")
	require.Equal(t, TopologyBalanced, p.Topology())

	// Everything behind: every connection is given back, the acquire
	// fails and the attempt is marked; the replica stays in the decisions
	// until BehindRun jobs in a row met nothing else.
	for _, n := range c.Replicas() {
		require.NoError(t, n.PauseReplay(ctxT(t)))
		t.Cleanup(func() { _ = n.ResumeReplay(context.Background()) })
	}
	_, need = f.write(t)
	for job := 1; job <= BehindRun; job++ {
		var a Attempt
		_, err = found(routed(ctxT(t), Target{Need: need, Attempt: &a}), p.Handlers(), id)
		require.ErrorIs(t, err, ErrReplicaBehind)
		require.True(t, a.Failed())
		require.True(t, a.Refused())
		excluded, exErr, _ := p.Excluded(time.Now())
		if job < BehindRun {
			require.False(t, excluded, "job %d of a run: chance, routed again", job)
			continue
		}
		require.True(t, excluded)
		require.ErrorIs(t, exErr, ErrReplicaBehind)
	}
	require.GreaterOrEqual(t, ev.count(CheckBehind), BehindRun*MaxRefusals)
}

// A replica whose new connections are reset: the first failed acquire
// leaves it out, failures in a row grow the exclusion, a re-probe that
// connects ends it. One exclusion, one readmission.
func TestUnreachableReplicaIsReprobed(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	f := newFixture(t, c)
	proxy, err := fault.NewProxy(net.JoinHostPort("127.0.0.1", strconv.Itoa(c.Replicas()[0].Port())))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	template, err := pgxpool.New(ctxT(t), fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&connect_timeout=2", proxy.Addr(), f.db))
	require.NoError(t, err)
	t.Cleanup(template.Close)
	ev := &events{}
	p := f.pool(t, template, ev)
	proxy.Refuse()

	_, need := f.write(t)
	var a Attempt
	_, err = p.Handlers().Acquire(routed(ctxT(t), Target{Need: need, Attempt: &a}))
	require.Error(t, err)
	require.True(t, a.Failed(), "the job learns that the replica failed it")
	excluded, exErr, until := p.Excluded(time.Now())
	require.True(t, excluded)
	require.ErrorIs(t, exErr, ErrUnreachable)
	require.WithinDuration(t, time.Now().Add(ExclusionBase), until, ExclusionBase)

	// Past the first exclusion, re-probes keep failing: the exclusion
	// grows and the replica stays out.
	var reprobes atomic.Int32
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) && reprobes.Load() < 2 {
		if ex, _, u := p.Excluded(time.Now()); ex && u.IsZero() {
			reprobes.Add(1)
			for {
				if _, _, u = p.Excluded(time.Now()); !u.IsZero() {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	excluded, _, until = p.Excluded(time.Now())
	require.True(t, excluded)
	require.Greater(t, time.Until(until), ExclusionBase, "the exclusion grew")

	proxy.Accept()
	require.Eventually(t, func() bool {
		ex, _, _ := p.Excluded(time.Now())
		return !ex
	}, MaxExclusion+10*time.Second, 20*time.Millisecond)
	ev.mu.Lock()
	defer ev.mu.Unlock()
	require.Equal(t, []Reason{ReasonUnreachable}, ev.excluded, "one exclusion however many failures")
	require.Equal(t, 1, ev.readmitted)
}
