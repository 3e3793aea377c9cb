package enqueue_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// env is one integration test's database on the shared cluster, with a
// table "items" that every replica already has.
type env struct {
	ctx context.Context
	c   *pgtest.Cluster
	db  string
}

func setup(t *testing.T) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	t.Cleanup(cancel)
	c := pgtest.Shared(t)
	e := &env{ctx: ctx, c: c, db: pgtest.NewDatabase(t, c)}
	require.NoError(t, c.Primary().Exec(ctx, e.db, "CREATE TABLE items (id bigint PRIMARY KEY)"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	return e
}

// conn opens a connection to database e.db on n, closed when the test ends
// (before the database is dropped).
func (e *env) conn(t *testing.T, n *pgtest.Node, configure ...func(*pgx.ConnConfig)) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(n.DSN(e.db))
	require.NoError(t, err)
	for _, f := range configure {
		f(cfg)
	}
	conn, err := pgx.ConnectConfig(e.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func (e *env) pool(t *testing.T, n *pgtest.Node) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(e.ctx, n.DSN(e.db))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// pause pauses replay on replica n until the test resumes it or ends.
func (e *env) pause(t *testing.T, n *pgtest.Node) {
	t.Helper()
	require.NoError(t, n.PauseReplay(e.ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = n.ResumeReplay(ctx)
	})
}

// epochOf is the test's own reading of a node's epoch (pgtest, not the code
// under test): system identifier and timeline.
func epochOf(t *testing.T, ctx context.Context, n *pgtest.Node) position.Epoch {
	t.Helper()
	sys, err := n.SystemIdentifier(ctx)
	require.NoError(t, err)
	tli, err := n.Timeline(ctx)
	require.NoError(t, err)
	return position.Epoch{SystemID: sys, Timeline: tli}
}

// replayLSN reads pg_last_wal_replay_lsn() on a replica connection.
func replayLSN(t *testing.T, ctx context.Context, conn *pgx.Conn) position.LSN {
	t.Helper()
	var s string
	require.NoError(t, conn.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text").Scan(&s))
	return position.MustParseLSN(s)
}

func visible(t *testing.T, ctx context.Context, conn *pgx.Conn, id int64) bool {
	t.Helper()
	var ok bool
	require.NoError(t, conn.QueryRow(ctx, "SELECT EXISTS (SELECT FROM items WHERE id = $1)", id).Scan(&ok))
	return ok
}

func entryFrom(t *testing.T, ctx context.Context, db string) position.Entry {
	t.Helper()
	tok, ok := enqueue.TokenFrom(ctx)
	require.True(t, ok, "the context carries no token")
	e, ok := tok.Entry(db)
	require.True(t, ok, "the token has no entry for %q: %v", db, tok)
	return e
}

func insert(t *testing.T, ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, id int64) {
	t.Helper()
	_, err := q.Exec(ctx, "INSERT INTO items (id) VALUES ($1)", id)
	require.NoError(t, err)
}

// waitCaughtUp polls replica until entry compares CaughtUp and checks, at
// that moment, that row id is visible there.
func waitCaughtUp(t *testing.T, ctx context.Context, entry position.Entry, epoch position.Epoch, rconn *pgx.Conn, id int64) {
	t.Helper()
	for {
		cmp := entry.Compare(position.Replayed{Epoch: epoch, LSN: replayLSN(t, ctx, rconn)}, nil)
		require.NotEqual(t, position.NotComparable, cmp.Status, cmp.Reason.String())
		if cmp.Status == position.CaughtUp {
			require.True(t, visible(t, ctx, rconn, id), "replica replayed the token but row %d is not visible", id)
			return
		}
		require.NoError(t, ctx.Err(), "replica never caught up with %v", entry)
		time.Sleep(2 * time.Millisecond)
	}
}

// (1) The token captured after COMMIT is not satisfied by a replica whose
// replay is paused, and is once replay resumes, and then the row is there.
func TestCommitTokenNotSatisfiedUntilReplayed(t *testing.T) {
	e := setup(t)
	primary, replica := e.c.Primary(), e.c.Replicas()[0]
	repEpoch := epochOf(t, e.ctx, replica)
	rconn := e.conn(t, replica)
	e.pause(t, replica)

	capt := enqueue.NewCapturer(enqueue.Config{})
	pconn := e.conn(t, primary)
	tx, err := pconn.Begin(e.ctx)
	require.NoError(t, err)
	insert(t, e.ctx, tx, 1)
	ctx, err := capt.Commit(e.ctx, tx)
	require.NoError(t, err)

	entry := entryFrom(t, ctx, "main")
	require.Equal(t, position.SourcePrimary, entry.Source)
	require.Equal(t, epochOf(t, e.ctx, primary), entry.Epoch)
	require.Equal(t, repEpoch, entry.Epoch, "a streaming replica shares the primary's epoch")

	cmp := entry.Compare(position.Replayed{Epoch: repEpoch, LSN: replayLSN(t, e.ctx, rconn)}, nil)
	require.Equal(t, position.Behind, cmp.Status)
	require.Positive(t, cmp.BytesBehind)
	require.False(t, visible(t, e.ctx, rconn, 1))

	require.NoError(t, replica.ResumeReplay(e.ctx))
	waitCaughtUp(t, e.ctx, entry, repEpoch, rconn, 1)
}

// (2) Why the position is read after COMMIT: a position read inside the
// writing transaction is passed by a replica that does not show the row
// yet, while the token Commit captures is not.
func TestPositionInsideTransactionIsTooEarly(t *testing.T) {
	e := setup(t)
	primary, replica := e.c.Primary(), e.c.Replicas()[0]
	repEpoch := epochOf(t, e.ctx, replica)
	rconn := e.conn(t, replica)
	require.NoError(t, primary.Exec(e.ctx, e.db, "CREATE TABLE pad (x int)"))

	pconn := e.conn(t, primary)
	tx, err := pconn.Begin(e.ctx)
	require.NoError(t, err)
	insert(t, e.ctx, tx, 1)
	var inTxText string
	require.NoError(t, tx.QueryRow(e.ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&inTxText))
	inTx := position.New("main", epochOf(t, e.ctx, primary), position.MustParseLSN(inTxText), position.SourcePrimary, time.Now()).Entries[0]

	// WAL of an open transaction is only flushed, and so only streamed,
	// when something pushes it out: a commit of another session does.
	require.NoError(t, primary.Exec(e.ctx, e.db, "INSERT INTO pad VALUES (1)"))
	require.NoError(t, replica.WaitReplay(e.ctx, inTxText))
	e.pause(t, replica) // the commit record below is not written yet

	ctx, err := enqueue.NewCapturer(enqueue.Config{}).Commit(e.ctx, tx)
	require.NoError(t, err)
	after := entryFrom(t, ctx, "main")
	require.Greater(t, after.LSN, inTx.LSN)

	rep := position.Replayed{Epoch: repEpoch, LSN: replayLSN(t, e.ctx, rconn)}
	require.Equal(t, position.CaughtUp, inTx.Compare(rep, nil).Status, "replay %s >= in-transaction position %s", rep.LSN, inTx.LSN)
	require.False(t, visible(t, e.ctx, rconn, 1), "the in-transaction position is satisfied, yet the row is not visible")
	require.Equal(t, position.Behind, after.Compare(rep, nil).Status, "the after-commit token %s is correctly not satisfied", after.LSN)

	require.NoError(t, replica.ResumeReplay(e.ctx))
	waitCaughtUp(t, e.ctx, after, repEpoch, rconn, 1)
}

// (3) With synchronous_commit = off, COMMIT returns before its commit
// record is flushed or streamed. The token (insert position after commit)
// must still never be satisfied before the row is visible. Rows are written
// while the replica is polled without pause; each poll checks every row
// whose token the replica's replay position has just reached.
func TestAsyncCommitTokenNeverEarly(t *testing.T) {
	e := setup(t)
	primary, replica := e.c.Primary(), e.c.Replicas()[1]
	repEpoch := epochOf(t, e.ctx, replica)
	rconn := e.conn(t, replica)
	pconn := e.conn(t, primary)
	_, err := pconn.Exec(e.ctx, "SET synchronous_commit = off")
	require.NoError(t, err)

	const n = 200
	type written struct {
		id    int64
		entry position.Entry
	}
	ch := make(chan written, n)
	var writeBelowToken int
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(ch)
		capt := enqueue.NewCapturer(enqueue.Config{})
		for i := int64(1); i <= n; i++ {
			tx, err := pconn.Begin(e.ctx)
			if err != nil {
				t.Error(err)
				return
			}
			if _, err := tx.Exec(e.ctx, "INSERT INTO items (id) VALUES ($1)", i); err != nil {
				t.Error(err)
				return
			}
			ctx, err := capt.Commit(e.ctx, tx)
			if err != nil {
				t.Error(err)
				return
			}
			tok, _ := enqueue.TokenFrom(ctx)
			ch <- written{id: i, entry: tok.Entries[0]}
			// The write position, read even later than the token, is
			// still often below it: the reason not to stamp it.
			var w string
			if err := pconn.QueryRow(e.ctx, "SELECT pg_current_wal_lsn()::text").Scan(&w); err != nil {
				t.Error(err)
				return
			}
			if position.MustParseLSN(w) < tok.Entries[0].LSN {
				writeBelowToken++
			}
		}
	})

	var pending []written
	checked, polls := 0, 0
	for open := true; open || len(pending) > 0; {
		for drained := false; !drained && open; {
			select {
			case w, ok := <-ch:
				if !ok {
					open = false
				} else {
					pending = append(pending, w)
				}
			default:
				drained = true
			}
		}
		rep := position.Replayed{Epoch: repEpoch, LSN: replayLSN(t, e.ctx, rconn)}
		polls++
		var due []int64
		pending = slices.DeleteFunc(pending, func(w written) bool {
			cmp := w.entry.Compare(rep, nil)
			require.NotEqual(t, position.NotComparable, cmp.Status)
			if cmp.Status == position.CaughtUp {
				due = append(due, w.id)
				return true
			}
			return false
		})
		if len(due) > 0 {
			var seen []int64
			rows, err := rconn.Query(e.ctx, "SELECT id FROM items WHERE id = ANY($1) ORDER BY id", due)
			require.NoError(t, err)
			seen, err = pgx.CollectRows(rows, pgx.RowTo[int64])
			require.NoError(t, err)
			require.Equal(t, due, seen, "replay %s reached these tokens, so every row must be visible", rep.LSN)
			checked += len(due)
		}
		require.NoError(t, e.ctx.Err(), "%d rows never caught up", len(pending))
	}
	wg.Wait()
	require.Equal(t, n, checked)
	t.Logf("%d rows checked in %d polls; pg_current_wal_lsn() was below the token after %d of %d async commits", checked, polls, writeBelowToken, n)
}

// (4) A replica-read token: what a read on one replica saw. A job that
// follows the read must not run on a replica that is further behind.
func TestReplicaRead(t *testing.T) {
	e := setup(t)
	primary := e.c.Primary()
	behind, ahead := e.c.Replicas()[0], e.c.Replicas()[1]
	repEpoch := epochOf(t, e.ctx, behind)
	behindConn, aheadConn := e.conn(t, behind), e.conn(t, ahead)
	e.pause(t, behind)

	capt := enqueue.NewCapturer(enqueue.Config{})
	pconn := e.conn(t, primary)
	insert(t, e.ctx, pconn, 1)
	wrote, err := capt.Capture(e.ctx, pconn)
	require.NoError(t, err)
	require.NoError(t, ahead.WaitReplay(e.ctx, wrote.Entries[0].LSN.String()))

	// The producer reads the row on the caught-up replica, then records
	// what that read saw.
	require.True(t, visible(t, e.ctx, aheadConn, 1))
	ctx := enqueue.WithToken(e.ctx, position.New("other", repEpoch, 1, position.SourcePrimary, time.Time{}))
	ctx, err = capt.AfterReplicaRead(ctx, aheadConn)
	require.NoError(t, err)
	tok, _ := enqueue.TokenFrom(ctx)
	require.Len(t, tok.Entries, 2, "merged with the token ctx had")
	read := entryFrom(t, ctx, "main")
	require.Equal(t, position.SourceReplica, read.Source)
	require.Equal(t, epochOf(t, e.ctx, ahead), read.Epoch)
	require.False(t, tok.CapturedAt.IsZero())

	require.Equal(t, position.CaughtUp, read.Compare(position.Replayed{Epoch: repEpoch, LSN: replayLSN(t, e.ctx, aheadConn)}, nil).Status)
	require.Equal(t, position.Behind, read.Compare(position.Replayed{Epoch: repEpoch, LSN: replayLSN(t, e.ctx, behindConn)}, nil).Status)
	require.False(t, visible(t, e.ctx, behindConn, 1))
	require.NoError(t, behind.ResumeReplay(e.ctx))
	waitCaughtUp(t, e.ctx, read, repEpoch, behindConn, 1)

	// Read from a server not in recovery: the primary's insert position.
	onPrimary, err := capt.ReplicaRead(e.ctx, pconn)
	require.NoError(t, err)
	require.Equal(t, position.SourcePrimary, onPrimary.Entries[0].Source)
	require.Equal(t, epochOf(t, e.ctx, primary), onPrimary.Entries[0].Epoch)
	require.GreaterOrEqual(t, onPrimary.Entries[0].LSN, wrote.Entries[0].LSN)
}

// An application role without pg_read_all_stats cannot see the standby's
// timeline; ReplicaRead says so rather than guess. Capture needs no
// privilege.
func TestReplicaReadNeedsReadAllStats(t *testing.T) {
	e := setup(t)
	primary, replica := e.c.Primary(), e.c.Replicas()[1]
	role := fmt.Sprintf("enqueue_app_%d", time.Now().UnixNano())
	require.NoError(t, primary.Exec(e.ctx, "", "CREATE ROLE "+role+" LOGIN"))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = primary.Exec(ctx, "", "DROP ROLE IF EXISTS "+role)
	})
	require.NoError(t, primary.Exec(e.ctx, e.db, "GRANT ALL ON items TO "+role))
	require.NoError(t, e.c.WaitReplicasCaughtUp(e.ctx))
	asRole := func(cfg *pgx.ConnConfig) { cfg.User = role }

	capt := enqueue.NewCapturer(enqueue.Config{})
	pconn := e.conn(t, primary, asRole)
	insert(t, e.ctx, pconn, 1)
	_, err := capt.Capture(e.ctx, pconn)
	require.NoError(t, err, "pg_current_wal_insert_lsn, pg_walfile_name and pg_control_system need no privilege")

	rconn := e.conn(t, replica, asRole)
	_, err = capt.ReplicaRead(e.ctx, rconn)
	require.ErrorIs(t, err, enqueue.ErrTimelineUnknown)
	require.ErrorContains(t, err, "pg_read_all_stats")

	require.NoError(t, primary.Exec(e.ctx, "", "GRANT pg_read_all_stats TO "+role))
	require.NoError(t, e.c.WaitReplicasCaughtUp(e.ctx))
	tok, err := capt.ReplicaRead(e.ctx, rconn)
	require.NoError(t, err)
	require.Equal(t, epochOf(t, e.ctx, replica), tok.Entries[0].Epoch)
}

// After a WAL switch (archive_timeout, pg_switch_wal) the insert position
// is past the new segment's page header, 40 bytes beyond where a replica's
// replay stops. The token is the segment boundary, so a replica of a quiet
// primary reaches it at once instead of at the next WAL record.
func TestTokenAfterWALSwitchIsReachable(t *testing.T) {
	e := setup(t)
	primary, replica := e.c.Primary(), e.c.Replicas()[1]
	repEpoch := epochOf(t, e.ctx, replica)
	pconn, rconn := e.conn(t, primary), e.conn(t, replica)
	capt := enqueue.NewCapturer(enqueue.Config{})
	_, err := capt.Capture(e.ctx, pconn) // read the control file now, not below
	require.NoError(t, err)

	rawInsert := func() position.LSN {
		var s string
		require.NoError(t, pconn.QueryRow(e.ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&s))
		return position.MustParseLSN(s)
	}
	var tok position.Token
	var raw position.LSN
	for attempt := 0; ; attempt++ {
		_, err := pconn.Exec(e.ctx, "SELECT pg_switch_wal()")
		require.NoError(t, err)
		raw = rawInsert()
		tok, err = capt.Capture(e.ctx, pconn)
		require.NoError(t, err)
		if rawInsert() == raw { // nothing else wrote WAL in between
			break
		}
		require.Less(t, attempt, 5, "the primary is never quiet")
	}
	const segment = 16 << 20 // pgtest's initdb default
	require.Equal(t, uint64(40), uint64(raw)%segment, "insert position %s is just past a segment's long page header", raw)
	entry := tok.Entries[0]
	require.Equal(t, raw-40, entry.LSN, "the token is the segment boundary")

	deadline := time.Now().Add(5 * time.Second) // without the adjustment: ~15 s, the next standby snapshot
	for {
		cmp := entry.Compare(position.Replayed{Epoch: repEpoch, LSN: replayLSN(t, e.ctx, rconn)}, nil)
		if cmp.Status == position.CaughtUp {
			break
		}
		require.True(t, time.Now().Before(deadline), "replica never reached %s: %+v", entry.LSN, cmp)
		time.Sleep(5 * time.Millisecond)
	}
}

// (5) What Commit returns when COMMIT fails, when the capture fails after
// a successful COMMIT, and when it is given a transaction it cannot
// capture after.
func TestCommitFailures(t *testing.T) {
	e := setup(t)
	primary := e.c.Primary()
	capt := enqueue.NewCapturer(enqueue.Config{})
	prior := position.New("main", position.Epoch{SystemID: 1, Timeline: 1}, 7, position.SourcePrimary, time.Now())
	base := enqueue.WithToken(e.ctx, prior)
	unchanged := func(t *testing.T, ctx context.Context) {
		t.Helper()
		require.Equal(t, base, ctx, "ctx must be returned unchanged")
	}
	pconn := e.conn(t, primary)
	absent := func(t *testing.T, id int64) {
		t.Helper()
		require.False(t, visible(t, e.ctx, pconn, id))
	}

	t.Run("commit fails", func(t *testing.T) {
		require.NoError(t, primary.Exec(e.ctx, e.db, `CREATE TABLE parent (id int PRIMARY KEY);
			CREATE TABLE child (pid int REFERENCES parent DEFERRABLE INITIALLY DEFERRED)`))
		tx, err := pconn.Begin(e.ctx)
		require.NoError(t, err)
		_, err = tx.Exec(e.ctx, "INSERT INTO child VALUES (1)") // checked at COMMIT
		require.NoError(t, err)
		ctx, err := capt.Commit(base, tx)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "23503", pgErr.Code)
		var ce *enqueue.CaptureError
		require.False(t, errors.As(err, &ce), "a failed COMMIT is pgx's error, not a CaptureError")
		unchanged(t, ctx)
	})

	t.Run("failed transaction", func(t *testing.T) {
		tx, err := pconn.Begin(e.ctx)
		require.NoError(t, err)
		insert(t, e.ctx, tx, 10)
		_, err = tx.Exec(e.ctx, "SELECT 1/0")
		require.Error(t, err)
		ctx, err := capt.Commit(base, tx)
		require.ErrorIs(t, err, pgx.ErrTxCommitRollback)
		unchanged(t, ctx)
		absent(t, 10)
	})

	t.Run("capture fails after commit", func(t *testing.T) {
		// Cancel the context the moment COMMIT has succeeded, so the
		// position query that follows fails.
		cctx, cancel := context.WithCancel(base)
		defer cancel()
		conn := e.conn(t, primary, func(cfg *pgx.ConnConfig) {
			cfg.Tracer = cancelAfterCommit{cancel}
		})
		tx, err := conn.Begin(cctx)
		require.NoError(t, err)
		insert(t, cctx, tx, 20)
		ctx, err := capt.Commit(cctx, tx)
		var ce *enqueue.CaptureError
		require.ErrorAs(t, err, &ce)
		require.True(t, ce.Committed)
		require.Equal(t, "main", ce.Database)
		require.ErrorIs(t, err, context.Canceled)
		require.Contains(t, err.Error(), "do not retry")
		require.Equal(t, cctx, ctx, "ctx returned unchanged")
		require.True(t, visible(t, e.ctx, pconn, 20), "the transaction committed")
	})

	t.Run("savepoint", func(t *testing.T) {
		tx, err := pconn.Begin(e.ctx)
		require.NoError(t, err)
		nested, err := tx.Begin(e.ctx)
		require.NoError(t, err)
		insert(t, e.ctx, nested, 30)
		ctx, err := capt.Commit(base, nested)
		var ce *enqueue.CaptureError
		require.ErrorAs(t, err, &ce)
		require.False(t, ce.Committed)
		require.ErrorIs(t, err, enqueue.ErrInTransaction)
		unchanged(t, ctx)
		// The outer transaction is still open; committing it works.
		ctx, err = capt.Commit(base, tx)
		require.NoError(t, err)
		require.Greater(t, entryFrom(t, ctx, "main").LSN, prior.Entries[0].LSN)
	})

	t.Run("pgxpool.Tx", func(t *testing.T) {
		pool := e.pool(t, primary)
		tx, err := pool.Begin(e.ctx)
		require.NoError(t, err)
		insert(t, e.ctx, tx, 40)
		ctx, err := capt.Commit(base, tx)
		require.ErrorIs(t, err, enqueue.ErrPoolTx)
		var ce *enqueue.CaptureError
		require.ErrorAs(t, err, &ce)
		require.False(t, ce.Committed)
		unchanged(t, ctx)
		require.NoError(t, tx.Rollback(e.ctx))
		absent(t, 40)
	})

	t.Run("capture inside a transaction", func(t *testing.T) {
		tx, err := pconn.Begin(e.ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(e.ctx) }()
		_, err = capt.Capture(e.ctx, pconn)
		require.ErrorIs(t, err, enqueue.ErrInTransaction)
	})

	t.Run("capture on a standby", func(t *testing.T) {
		_, err := capt.Capture(e.ctx, e.conn(t, e.c.Replicas()[1]))
		require.ErrorIs(t, err, enqueue.ErrNotPrimary)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, "the server's error is kept")
	})
}

// cancelAfterCommit cancels a context when a COMMIT has succeeded.
type cancelAfterCommit struct{ cancel context.CancelFunc }

func (c cancelAfterCommit) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (c cancelAfterCommit) TraceQueryEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if d.Err == nil && d.CommandTag.String() == "COMMIT" {
		c.cancel()
	}
}

// (5) Context merging across writes, databases and the helpers.
func TestMergingAndHelpers(t *testing.T) {
	e := setup(t)
	primary := e.c.Primary()
	pool := e.pool(t, primary)
	mainDB := enqueue.NewCapturer(enqueue.Config{})
	otherDB := enqueue.NewCapturer(enqueue.Config{Database: "other"})

	ctx, err := mainDB.InTx(e.ctx, pool, func(tx pgx.Tx) error {
		insert(t, e.ctx, tx, 1)
		return nil
	})
	require.NoError(t, err)
	first := entryFrom(t, ctx, "main")
	firstAt, _ := enqueue.TokenFrom(ctx)

	ctx, err = enqueue.InTx(ctx, pool, func(tx pgx.Tx) error { // package level: "main"
		insert(t, e.ctx, tx, 2)
		return nil
	})
	require.NoError(t, err)
	second := entryFrom(t, ctx, "main")
	require.Greater(t, second.LSN, first.LSN, "the later write's position is kept")
	tok, _ := enqueue.TokenFrom(ctx)
	require.Equal(t, firstAt.CapturedAt, tok.CapturedAt, "the oldest capture time is kept")

	conn, err := pool.Acquire(e.ctx)
	require.NoError(t, err)
	insert(t, e.ctx, conn, 3)
	ctx, err = otherDB.AfterWrite(ctx, conn.Conn())
	require.NoError(t, err)
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	insert(t, e.ctx, tx, 4)
	ctx, err = enqueue.Commit(ctx, tx)
	require.NoError(t, err)
	conn.Release()

	tok, _ = enqueue.TokenFrom(ctx)
	require.Len(t, tok.Entries, 2)
	require.Equal(t, "main", tok.Entries[0].Database)
	require.Equal(t, "other", tok.Entries[1].Database)
	require.Greater(t, tok.Entries[0].LSN, tok.Entries[1].LSN, "main's last write came after other's")
	back, err := position.Decode(tok.String())
	require.NoError(t, err)
	require.Equal(t, tok.Entries, back.Entries)

	t.Run("fn fails", func(t *testing.T) {
		boom := errors.New("boom")
		got, err := mainDB.InTx(ctx, pool, func(tx pgx.Tx) error {
			insert(t, e.ctx, tx, 5)
			return boom
		})
		require.ErrorIs(t, err, boom)
		require.Equal(t, ctx, got)
		require.False(t, visible(t, e.ctx, e.conn(t, primary), 5))
	})

	t.Run("fn panics", func(t *testing.T) {
		require.PanicsWithValue(t, "boom", func() {
			_, _ = mainDB.InTx(ctx, pool, func(tx pgx.Tx) error {
				insert(t, e.ctx, tx, 6)
				panic("boom")
			})
		})
		require.False(t, visible(t, e.ctx, e.conn(t, primary), 6))
		require.Zero(t, pool.Stat().AcquiredConns(), "the connection went back to the pool")
	})

	t.Run("session", func(t *testing.T) {
		sctx := enqueue.WithSession(e.ctx)
		createUser := func(ctx context.Context) {
			_, err := mainDB.InTx(ctx, pool, func(tx pgx.Tx) error {
				insert(t, e.ctx, tx, 7)
				return nil
			})
			require.NoError(t, err)
		}
		createUser(sctx) // drops the returned context
		require.Greater(t, entryFrom(t, sctx, "main").LSN, second.LSN)
	})

	t.Run("options", func(t *testing.T) {
		_, err := mainDB.InTxOptions(e.ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
			_, err := tx.Exec(e.ctx, "INSERT INTO items (id) VALUES (8)")
			return err
		})
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr)
		require.Equal(t, "25006", pgErr.Code) // read_only_sql_transaction
	})
}

// The system identifier is read once per connection and refresh period;
// the timeline is read with every position.
func TestSystemIDCache(t *testing.T) {
	e := setup(t)
	var mu sync.Mutex
	var queries []string
	record := func(cfg *pgx.ConnConfig) {
		cfg.Tracer = sqlRecorder(func(sql string) {
			mu.Lock()
			queries = append(queries, sql)
			mu.Unlock()
		})
	}
	last := func() string {
		mu.Lock()
		defer mu.Unlock()
		return queries[len(queries)-1]
	}
	now := time.Date(2025, 11, 29, 12, 0, 0, 0, time.UTC)
	capt := enqueue.NewCapturer(enqueue.Config{
		SystemIDRefresh: time.Minute,
		Now:             func() time.Time { return now },
	})
	readsSysID := func(t *testing.T, conn *pgx.Conn, read func(context.Context, *pgx.Conn) (position.Token, error)) bool {
		t.Helper()
		tok, err := read(e.ctx, conn)
		require.NoError(t, err)
		require.Equal(t, now, tok.CapturedAt, "Config.Now stamps the token")
		q := last()
		require.Contains(t, q, "pg_walfile_name", "the timeline is read every time")
		return strings.Contains(q, "pg_control_system")
	}

	for name, tc := range map[string]struct {
		node *pgtest.Node
		read func(context.Context, *pgx.Conn) (position.Token, error)
	}{
		"Capture":     {e.c.Primary(), capt.Capture},
		"ReplicaRead": {e.c.Replicas()[1], capt.ReplicaRead},
	} {
		t.Run(name, func(t *testing.T) {
			start := now
			conn := e.conn(t, tc.node, record)
			require.True(t, readsSysID(t, conn, tc.read), "first use of a connection")
			require.False(t, readsSysID(t, conn, tc.read), "cached")
			now = now.Add(59 * time.Second)
			require.False(t, readsSysID(t, conn, tc.read), "cached")
			now = now.Add(time.Second)
			require.True(t, readsSysID(t, conn, tc.read), "refresh due")
			require.False(t, readsSysID(t, conn, tc.read), "cached again")
			require.True(t, readsSysID(t, e.conn(t, tc.node, record), tc.read), "a new connection reads it")
			now = start
		})
	}
}

type sqlRecorder func(sql string)

func (r sqlRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r(d.SQL)
	return ctx
}

func (r sqlRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// After a promotion the timeline in the token changes at once, on the same
// connection: it is read with every position, never cached.
func TestTimelineAfterPromotion(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	capt := enqueue.NewCapturer(enqueue.Config{})

	oldPrimary, standby := c.Primary(), c.Replicas()[0]
	pconn, err := pgx.Connect(ctx, oldPrimary.DSN(""))
	require.NoError(t, err)
	before, err := capt.Capture(ctx, pconn)
	require.NoError(t, err)
	_ = pconn.Close(ctx)
	require.NoError(t, standby.WaitReplay(ctx, before.Entries[0].LSN.String()))

	conn, err := pgx.Connect(ctx, standby.DSN(""))
	require.NoError(t, err)
	defer func() { _ = conn.Close(context.Background()) }()
	read, err := capt.ReplicaRead(ctx, conn)
	require.NoError(t, err)
	require.Equal(t, position.SourceReplica, read.Entries[0].Source)
	require.Equal(t, before.Entries[0].Epoch, read.Entries[0].Epoch)
	_, err = capt.Capture(ctx, conn)
	require.ErrorIs(t, err, enqueue.ErrNotPrimary)

	require.NoError(t, c.Promote(ctx, standby))

	after, err := capt.Capture(ctx, conn) // same connection, now to a primary
	require.NoError(t, err)
	ae, be := after.Entries[0], before.Entries[0]
	require.Equal(t, be.Epoch.SystemID, ae.Epoch.SystemID)
	require.Equal(t, be.Epoch.Timeline+1, ae.Epoch.Timeline)
	require.Greater(t, ae.LSN, be.LSN)
	require.Equal(t, epochOf(t, ctx, standby), ae.Epoch)

	merged := before.Merge(after)
	require.Equal(t, ae.Epoch, merged.Entries[0].Epoch, "a token spanning the failover names the new timeline")
	reread, err := capt.ReplicaRead(ctx, conn)
	require.NoError(t, err)
	require.Equal(t, position.SourcePrimary, reread.Entries[0].Source, "no longer in recovery")
	require.Equal(t, ae.Epoch, reread.Entries[0].Epoch)
}

// CaptureCommitted, read inside a transaction after it saw another
// session's committed row, covers that row's commit: a replica that has
// replayed the token shows the row.
func TestCaptureCommittedCoversRowsTheSnapshotSees(t *testing.T) {
	e := setup(t)
	capt := enqueue.NewCapturer(enqueue.Config{})
	writer := e.conn(t, e.c.Primary())
	written, err := capt.InTx(e.ctx, e.pool(t, e.c.Primary()), func(tx pgx.Tx) error {
		_, err := tx.Exec(e.ctx, "INSERT INTO items VALUES (1)")
		return err
	})
	require.NoError(t, err)
	want, _ := enqueue.TokenFrom(written)

	tx, err := writer.Begin(e.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(e.ctx) }()
	var n int
	require.NoError(t, tx.QueryRow(e.ctx, "SELECT count(*) FROM items WHERE id = 1").Scan(&n))
	require.Equal(t, 1, n)
	tok, err := capt.CaptureCommitted(e.ctx, tx)
	require.NoError(t, err, "a transaction reading others' commits may capture")
	got, ok := tok.Entry("main")
	require.True(t, ok)
	wantEntry, _ := want.Entry("main")
	require.Equal(t, wantEntry.Epoch, got.Epoch)
	require.GreaterOrEqual(t, got.LSN, wantEntry.LSN)

	_, err = capt.CaptureCommitted(e.ctx, nil)
	require.Error(t, err)
}
