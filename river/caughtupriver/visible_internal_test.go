package caughtupriver

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertest"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// A read's position stands for the jobs its scan saw only because the
// scan returned before the position was read. The position query is held
// after it ran while a job commits: the job must not be registered with
// that position (it was read before the job's commit). The job committed
// before the scan is registered, with a position at or past its commit;
// a job fetched since, or with another attempt, is not looked up.
func TestVisibleScanBeforeRead(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	plain, err := c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	defer plain.Close()
	m, err := rivermigrate.New(riverpgxv5.New(plain), nil)
	require.NoError(t, err)
	_, err = m.Migrate(ctx, rivermigrate.DirectionUp, nil)
	require.NoError(t, err)
	client, err := river.NewClient(riverpgxv5.New(plain), &river.Config{})
	require.NoError(t, err)
	pcfg, err := pgxpool.ParseConfig(c.Primary().DSN(db))
	require.NoError(t, err)
	g := &gate{reached: make(chan struct{}), open: make(chan struct{})}
	pcfg.ConnConfig.Tracer = g
	gated, err := pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	defer gated.Close()
	met, err := newMetrics(noop.NewMeterProvider())
	require.NoError(t, err)
	capt := enqueue.NewCapturer(enqueue.Config{})
	p := &fetchPositions{pool: gated, capture: capt, timeout: 30 * time.Second, met: met}

	insert := func() (*rivertype.JobRow, uint64) {
		res, err := client.Insert(ctx, wakeArgs{}, nil)
		require.NoError(t, err)
		conn, err := plain.Acquire(ctx)
		require.NoError(t, err)
		defer conn.Release()
		tok, err := capt.Capture(ctx, conn.Conn())
		require.NoError(t, err)
		e, _ := tok.Entry("main")
		return res.Job, uint64(e.LSN)
	}
	before, beforeLSN := insert()

	wctx := rivertest.WorkContext(ctx, client)
	done := make(chan error, 1)
	var readLSN uint64
	go func() {
		tok, err := p.token(wctx)
		if err == nil {
			e, _ := tok.Entry("main")
			readLSN = uint64(e.LSN)
		}
		done <- err
	}()
	<-g.reached // the position was read, and is held
	after, afterLSN := insert()
	close(g.open)
	require.NoError(t, <-done)
	require.GreaterOrEqual(t, readLSN, beforeLSN)
	require.Less(t, readLSN, afterLSN, "the held read ran before the second job's commit")

	v, _ := p.visible.of(wctx)
	require.NotNil(t, v)
	fetched := func(job *rivertype.JobRow, attempt int) *rivertype.JobRow {
		j := *job
		j.Attempt = attempt
		return &j
	}
	_, ok := v.lookup(fetched(after, 1))
	require.False(t, ok, "a job committed after the scan has no earlier position")
	_, ok = v.lookup(fetched(before, 2))
	require.False(t, ok, "a job fetched with another attempt than the scan's plus one ran since")
	_, ok = v.lookup(fetched(before, 1))
	require.False(t, ok, "a job is looked up once")

	// Registered again by a new read, the job's position covers it.
	tok, err := p.token(wctx)
	require.NoError(t, err)
	v, _ = p.visible.of(wctx)
	got, ok := v.lookup(fetched(after, 1))
	require.True(t, ok, "the second job, committed and available, is registered by the next read")
	require.Equal(t, tok.Entries, got.Entries)
	e, _ := got.Entry("main")
	require.GreaterOrEqual(t, uint64(e.LSN), afterLSN)
}

// flushTo flushes the primary's WAL up to a position past its flush
// position: an xid taken alone is committed without a flush, so the
// insert position is past the flushed WAL until the WAL writer's next
// round (200ms), and the check comes within milliseconds.
func TestFlushTo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	pool, err := c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	defer pool.Close()
	met, err := newMetrics(noop.NewMeterProvider())
	require.NoError(t, err)
	capt := enqueue.NewCapturer(enqueue.Config{})
	p := &fetchPositions{pool: pool, capture: capt, timeout: 30 * time.Second, met: met}
	flushed := func() uint64 {
		var s string
		require.NoError(t, pool.QueryRow(ctx, `SELECT pg_current_wal_flush_lsn()::text`).Scan(&s))
		lsn, err := position.ParseLSN(s)
		require.NoError(t, err)
		return uint64(lsn)
	}
	for range 3 {
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		_, err = conn.Exec(ctx, `SELECT pg_current_xact_id()`)
		require.NoError(t, err)
		tok, err := capt.Capture(ctx, conn.Conn())
		conn.Release()
		require.NoError(t, err)
		e, _ := tok.Entry("main")
		if flushed() >= uint64(e.LSN) {
			continue // flushed meanwhile by someone else: try again
		}
		p.flushTo(ctx, tok)
		require.GreaterOrEqual(t, flushed(), uint64(e.LSN), "the WAL up to the position is flushed")
		return
	}
	t.Fatal("the WAL was flushed before every check: no unflushed tail to test with")
}
