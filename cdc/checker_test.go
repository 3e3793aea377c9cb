package cdc

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/replicatest"
)

// openChange is a transaction that has made its change but may not have
// committed: what a Debezium envelope would describe.
type openChange struct {
	conn  *pgx.Conn
	tx    pgx.Tx
	id    int64
	xid8  uint64
	lsn   position.LSN // insert LSN read right after the INSERT: Debezium's kind of position
	after position.LSN // insert LSN read right after COMMIT
}

// beginChange opens a transaction on the primary, notes its xid, inserts a
// row and reads the insert LSN, like the position Debezium reports for the
// change (below the transaction's commit). With savepoint the row is
// written in a subtransaction, whose own xid Debezium never reports.
func (e *env) beginChange(ctx context.Context, id int64, savepoint bool) (*openChange, error) {
	conn, err := pgx.Connect(ctx, e.Cluster.Primary().DSN(e.Database))
	if err != nil {
		return nil, err
	}
	c := &openChange{conn: conn, id: id}
	fail := func(err error) (*openChange, error) { _ = conn.Close(context.Background()); return nil, err }
	if c.tx, err = conn.Begin(ctx); err != nil {
		return fail(err)
	}
	var x string
	if err := c.tx.QueryRow(ctx, "SELECT pg_current_xact_id()::text").Scan(&x); err != nil {
		return fail(err)
	}
	if c.xid8, err = strconv.ParseUint(x, 10, 64); err != nil {
		return fail(err)
	}
	if savepoint {
		if _, err := c.tx.Exec(ctx, "SAVEPOINT s"); err != nil {
			return fail(err)
		}
	}
	var lsn string
	if err := c.tx.QueryRow(ctx, "WITH i AS (INSERT INTO cdc (id) VALUES ($1) RETURNING 1) SELECT pg_current_wal_insert_lsn()::text FROM i", id).Scan(&lsn); err != nil {
		return fail(err)
	}
	c.lsn = position.MustParseLSN(lsn)
	if savepoint {
		if _, err := c.tx.Exec(ctx, "RELEASE SAVEPOINT s"); err != nil {
			return fail(err)
		}
	}
	return c, nil
}

// finish commits (or rolls back) and closes the connection.
func (c *openChange) finish(ctx context.Context, commit bool) error {
	defer func() { _ = c.conn.Close(context.Background()) }()
	if !commit {
		return c.tx.Rollback(ctx)
	}
	if err := c.tx.Commit(ctx); err != nil {
		return err
	}
	var after string
	if err := c.conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&after); err != nil {
		return err
	}
	c.after = position.MustParseLSN(after)
	return nil
}

// envelope renders the change as Debezium's PostgreSQL connector would:
// a 32-bit txId and the change's LSN as an integer.
func (c *openChange) envelope(db string) []byte {
	b, _ := json.Marshal(map[string]any{
		"schema": map[string]any{"type": "struct"},
		"payload": map[string]any{
			"before": nil,
			"after":  map[string]any{"id": c.id},
			"source": map[string]any{
				"version": "2.5.0.Final", "connector": "postgresql", "name": "srv", "ts_ms": time.Now().UnixMilli(),
				"snapshot": "false", "db": db, "schema": "public", "table": "cdc",
				"txId": c.xid8 & 0xFFFFFFFF, "lsn": uint64(c.lsn), "xmin": nil,
				"sequence": fmt.Sprintf(`["%d","%d"]`, uint64(c.lsn)-100, uint64(c.lsn)),
			},
			"op": "c", "ts_ms": time.Now().UnixMilli(),
		},
	})
	return b
}

func (e *env) visibleOnReplica(ctx context.Context, id int64) (bool, error) {
	var n int
	err := e.Replica.QueryRow(ctx, "SELECT count(*) FROM cdc WHERE id = $1", id).Scan(&n)
	return n == 1, err
}

// TestDebeziumRuleStepByStep walks one transaction through the states a
// replica can be in and checks the rule at each, together with what the
// replica actually shows. The third state is the one that defeats
// replay >= source.lsn: the change is replayed, the commit is not.
//
// Not parallel: it pauses replay on the shared cluster's first replica.
func TestDebeziumRuleStepByStep(t *testing.T) {
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	checker, err := NewChecker(Config{QueryTimeout: time.Minute})
	require.NoError(t, err)

	for _, savepoint := range []bool{false, true} {
		t.Run(fmt.Sprintf("savepoint=%v", savepoint), func(t *testing.T) {
			id := int64(map[bool]int{false: 1, true: 2}[savepoint])
			state := func(wantStatus Status, wantReason Reason, wantVisible bool, c *openChange) Result {
				t.Helper()
				_, res := checker.CheckEnvelope(ctx, e.Replica, c.envelope(e.Database))
				vis, err := e.visibleOnReplica(ctx, id)
				require.NoError(t, err)
				require.Equal(t, wantVisible, vis, "row visible on the replica")
				require.Equal(t, wantStatus, res.Status, "%+v", res)
				require.Equal(t, wantReason, res.Reason, "%+v", res)
				return res
			}

			// 1. Replay paused before the transaction began.
			require.NoError(t, e.PauseReplay(ctx))
			c, err := e.beginChange(ctx, id, savepoint)
			require.NoError(t, err)
			res := state(StatusNotYet, ReasonReplayBehind, false, c)
			require.Less(t, res.ReplayLSN, c.lsn)

			// 2. Replay runs past the change while the transaction is
			// still open, then pauses again.
			require.NoError(t, e.ReplicaNode.ResumeReplay(ctx))
			require.NoError(t, e.FlushWAL(ctx))
			require.NoError(t, e.ReplicaNode.WaitReplay(ctx, c.lsn.String()))
			require.NoError(t, e.PauseReplay(ctx))
			res = state(StatusNotYet, ReasonInProgress, false, c)
			require.GreaterOrEqual(t, res.ReplayLSN, c.lsn, "replay >= source.lsn would call this fresh")
			require.Equal(t, c.xid8, res.XID, "widened xid is the transaction's xid8")
			require.Equal(t, "in progress", res.XactStatus)

			// 3. Committed on the primary, commit not replayed.
			require.NoError(t, c.finish(ctx, true))
			res = state(StatusNotYet, ReasonInProgress, false, c)
			require.Less(t, res.ReplayLSN, c.after)

			// 4. Commit replayed.
			require.NoError(t, e.ReplicaNode.ResumeReplay(ctx))
			require.NoError(t, e.ReplicaNode.WaitReplay(ctx, c.after.String()))
			res = state(StatusFresh, ReasonNone, true, c)
			require.Equal(t, "committed", res.XactStatus)

			// The same event with a wrong epoch names an xid the standby has
			// never seen: "in the future", not yet.
			src := Source{Connector: "postgresql", LSN: c.lsn, TxID: c.xid8 + 1<<32}
			res = checker.Check(ctx, e.Replica, src)
			require.Equal(t, StatusNotYet, res.Status)
			require.Equal(t, ReasonFuture, res.Reason)
		})
	}

	t.Run("aborted", func(t *testing.T) {
		c, err := e.beginChange(ctx, 3, false)
		require.NoError(t, err)
		require.NoError(t, c.finish(ctx, false))
		var now string
		require.NoError(t, e.Primary.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&now))
		require.NoError(t, e.ReplicaNode.WaitReplay(ctx, now))
		_, res := checker.CheckEnvelope(ctx, e.Replica, c.envelope(e.Database))
		require.Equal(t, StatusUnknown, res.Status)
		require.Equal(t, ReasonAborted, res.Reason)
	})

	t.Run("primary is not a standby", func(t *testing.T) {
		c, err := e.beginChange(ctx, 4, false)
		require.NoError(t, err)
		require.NoError(t, c.finish(ctx, true))
		_, res := checker.CheckEnvelope(ctx, e.Primary, c.envelope(e.Database))
		require.Equal(t, StatusUnknown, res.Status)
		require.Equal(t, ReasonNotStandby, res.Reason)
	})
}

// TestDebeziumRuleNeverFreshBeforeVisible hammers the rule: writers run
// transactions of several shapes (one row, a subtransaction, a pause
// between change and commit, rollbacks) and publish each envelope as soon
// as the change is made — earlier than Debezium would, to probe the
// window between change and commit — while replay is paused and resumed
// at random. Checkers check envelopes on the replica and, whenever the
// rule says fresh, read the row there at once. It must always be there.
// The naive rule replay >= source.lsn is scored on the same observations.
//
// Not parallel: it pauses replay on the shared cluster's first replica.
func TestDebeziumRuleNeverFreshBeforeVisible(t *testing.T) {
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	checker, err := NewChecker(Config{QueryTimeout: time.Minute})
	require.NoError(t, err)

	type published struct {
		envelope []byte
		id       int64
		lsn      position.LSN
		aborted  bool
	}
	var (
		mu    sync.Mutex
		queue []published
		// first is closed when queue gets its first envelope.
		first     = make(chan struct{})
		firstOnce sync.Once
	)
	stopToggling := e.ToggleReplay(t, ctx)
	const writers, perWriter = 4, 40
	var wg sync.WaitGroup
	var writersDone atomic.Bool
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWriter {
				id := int64(w*1000 + i)
				shape := rand.IntN(4)
				c, err := e.beginChange(ctx, id, shape == 1)
				if !assert.NoError(t, err) {
					return
				}
				mu.Lock()
				queue = append(queue, published{envelope: c.envelope(e.Database), id: id, lsn: c.lsn, aborted: shape == 3})
				mu.Unlock()
				firstOnce.Do(func() { close(first) })
				if shape == 2 {
					// Hold the transaction open between change and commit.
					replicatest.Sleep(ctx, time.Duration(5+rand.IntN(20))*time.Millisecond)
				}
				if !assert.NoError(t, c.finish(ctx, shape != 3)) {
					return
				}
			}
		}()
	}
	go func() { wg.Wait(); writersDone.Store(true) }()

	var (
		checks, fresh, notYet, unknown, stale atomic.Int64
		naiveFresh, naiveStale, freshAborted  atomic.Int64
		unknownCommitted                      atomic.Int64
		reasons                               sync.Map
	)
	var cwg sync.WaitGroup
	for range 3 {
		cwg.Add(1)
		go func() {
			defer cwg.Done()
			select {
			case <-first:
			case <-ctx.Done():
				return
			}
			for ctx.Err() == nil {
				mu.Lock()
				n := len(queue)
				var p published
				switch {
				case rand.IntN(2) == 0:
					// Recent envelopes, whose transactions may still be
					// open: where the change-versus-commit window is.
					p = queue[n-1-rand.IntN(min(n, 4))]
				default:
					p = queue[rand.IntN(n)]
				}
				mu.Unlock()
				_, res := checker.CheckEnvelope(ctx, e.Replica, p.envelope)
				// Read right after the check, on the same replica, as a
				// consumer would.
				vis, err := e.visibleOnReplica(ctx, p.id)
				if err != nil {
					if ctx.Err() == nil {
						t.Errorf("read: %v", err)
					}
					return
				}
				checks.Add(1)
				if v, _ := reasons.LoadOrStore(res.Reason.String(), new(atomic.Int64)); v != nil {
					v.(*atomic.Int64).Add(1)
				}
				switch res.Status {
				case StatusFresh:
					fresh.Add(1)
					if !vis {
						stale.Add(1)
					}
					if p.aborted {
						freshAborted.Add(1)
					}
				case StatusNotYet:
					notYet.Add(1)
				default:
					unknown.Add(1)
					if !p.aborted {
						unknownCommitted.Add(1)
					}
				}
				if res.ReplayLSN != 0 && res.ReplayLSN >= p.lsn && !p.aborted {
					naiveFresh.Add(1)
					if !vis {
						naiveStale.Add(1)
					}
				}
				if writersDone.Load() && checks.Load() > 3000 {
					return
				}
			}
		}()
	}
	cwg.Wait()
	stopToggling()
	require.NoError(t, ctx.Err())
	var rs []string
	reasons.Range(func(k, v any) bool { rs = append(rs, fmt.Sprintf("%s=%d", k, v.(*atomic.Int64).Load())); return true })
	t.Logf("%d checks: fresh %d, not yet %d, unknown %d (%v); stale reads after fresh: %d; fresh for rolled-back transactions: %d",
		checks.Load(), fresh.Load(), notYet.Load(), unknown.Load(), rs, stale.Load(), freshAborted.Load())
	t.Logf("unknown for transactions that did commit: %d", unknownCommitted.Load())
	t.Logf("naive rule replay >= source.lsn on the same observations: %d fresh, %d of them stale", naiveFresh.Load(), naiveStale.Load())
	require.Zero(t, stale.Load(), "the rule called a replica fresh before the row was visible there")
	require.Zero(t, freshAborted.Load())
	require.NotZero(t, fresh.Load(), "the rule never said fresh: the test proves nothing")
	require.NotZero(t, notYet.Load())
}

// TestCheckerBoundsItsQueries: a replica that does not answer is unknown
// after Config.QueryTimeout, even when the caller's context has no
// deadline, and unknown reads the primary. The replica's pool dials
// through a fault.Dialer that holds every new connection, as an
// unreachable host would.
func TestCheckerBoundsItsQueries(t *testing.T) {
	t.Parallel()
	e := setup(t)
	cfg, err := pgxpool.ParseConfig(e.ReplicaNode.DSN(e.Database))
	require.NoError(t, err)
	d := fault.NewDialer(nil)
	cfg.ConnConfig.DialFunc = d.DialContext
	d.Hold()
	defer d.Release()
	wedged, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer wedged.Close()

	checker, err := NewChecker(Config{QueryTimeout: 100 * time.Millisecond})
	require.NoError(t, err)
	res := checker.Check(context.Background(), wedged, Source{Connector: "postgresql", LSN: 0x100, TxID: 1000})
	require.Equal(t, StatusUnknown, res.Status)
	require.Equal(t, ReasonReplicaError, res.Reason)
	require.ErrorIs(t, res.Err, context.DeadlineExceeded)
}

func TestConfig(t *testing.T) {
	t.Parallel()
	require.NoError(t, Config{}.WithDefaults().Validate())
	require.Equal(t, DefaultQueryTimeout, Config{}.WithDefaults().QueryTimeout)
	_, err := NewChecker(Config{QueryTimeout: -time.Second})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "QueryTimeout")
}
