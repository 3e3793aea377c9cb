package caughtupriver

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// gate is a pgx tracer that holds the first query's result until opened:
// that query has run on the server, and its caller has not seen it yet.
type gate struct {
	once    sync.Once
	reached chan struct{}
	open    chan struct{}
}

func (g *gate) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (g *gate) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {
	first := false
	g.once.Do(func() { first = true })
	if first {
		close(g.reached)
		<-g.open
	}
}

// A job that arrives while a read is under way must not take that read's
// position, which may predate its fetch: it waits for the next read. The
// first read's position is held back while a write commits; the job that
// arrives after the write must get a position past it.
func TestFetchPositionsJoinOnlyLaterReads(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	plain, err := c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	defer plain.Close()
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

	first := make(chan error, 1)
	var firstLSN uint64
	go func() {
		tok, err := p.token(ctx)
		if err == nil {
			e, _ := tok.Entry("main")
			firstLSN = uint64(e.LSN)
		}
		first <- err
	}()
	<-g.reached // the first read has run and is held

	_, err = plain.Exec(ctx, `CREATE TABLE w (id int)`)
	require.NoError(t, err)
	conn, err := plain.Acquire(ctx)
	require.NoError(t, err)
	written, err := capt.Capture(ctx, conn.Conn())
	conn.Release()
	require.NoError(t, err)
	want, _ := written.Entry("main")

	second := make(chan error, 1)
	var secondLSN uint64
	go func() {
		tok, err := p.token(ctx)
		if err == nil {
			e, _ := tok.Entry("main")
			secondLSN = uint64(e.LSN)
		}
		second <- err
	}()
	// The second caller is waiting (for the next read, or, were the rule
	// broken, for the held one).
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.open != nil
	}, 10*time.Second, time.Millisecond)
	close(g.open)
	require.NoError(t, <-first)
	require.NoError(t, <-second)
	require.Less(t, firstLSN, uint64(want.LSN), "the held read ran before the write")
	require.GreaterOrEqual(t, secondLSN, uint64(want.LSN), "a job that arrived after the write got a position before it")
}
