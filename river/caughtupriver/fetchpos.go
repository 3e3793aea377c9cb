package caughtupriver

import (
	"context"
	"runtime"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// fetchPositions reads the primary's position for jobs that were fetched,
// sharing one read among every job waiting at the moment it starts.
//
// Why a read after the fetch is a token: River fetches a job only once the
// transaction that inserted it has committed, and a job reaches the
// middleware only after its fetch returned. pg_current_wal_insert_lsn()
// read by a query sent after that is at or past the end of that
// transaction's commit record (the record is inserted before the
// transaction becomes visible), so a replica that has replayed it shows
// the job's row and everything its transaction wrote.
//
// Why sharing is sound: a read covers the jobs that reached token before
// the read's query was sent. So a job joins a read only while that read
// is open, before its connection is in hand and its query goes out; one
// that arrives later waits for the next read, which starts as soon as the
// current one ends. The jobs River starts from one fetched batch arrive
// together: the first opens a read, and the rest join it while it takes a
// connection (the read yields once, so that runnable siblings can). Under
// load, one read serves every job that arrived during the previous read's
// round trip. No clock is compared: the order is the process's own (a
// mutex), so clock skew between the worker and the database cannot make
// a read look newer than a fetch.
type fetchPositions struct {
	pool    *pgxpool.Pool
	capture *enqueue.Capturer
	timeout time.Duration
	met     *metrics
	visible visibleRegistry

	mu   sync.Mutex
	open *flight // the read that jobs arriving now join: its query is not sent yet
	busy bool    // a read is open or under way; at most one is
}

// flight is one read of the primary's position and the jobs waiting for
// it.
type flight struct {
	done chan struct{}
	tok  position.Token
	err  error
}

// token returns the primary's position read by a query sent after token
// was called. ctx bounds only the wait: the read itself is shared and runs
// under its own timeout.
func (p *fetchPositions) token(ctx context.Context) (position.Token, error) {
	p.mu.Lock()
	f, lead := p.open, false
	if f == nil {
		f = &flight{done: make(chan struct{})}
		p.open = f
		lead = !p.busy
		p.busy = true
	}
	p.mu.Unlock()
	if lead {
		// The job that opens an idle reader's read runs it itself: an
		// idle worker pays no goroutine.
		p.run(ctx, f)
	}
	select {
	case <-f.done:
		return f.tok, f.err
	case <-ctx.Done():
		return position.Token{}, ctx.Err()
	}
}

// seal closes f to new jobs; it is called before f's query is sent.
func (p *fetchPositions) seal(f *flight) {
	p.mu.Lock()
	if p.open == f {
		p.open = nil
	}
	p.mu.Unlock()
}

// run reads for f, then starts the read that jobs opened meanwhile, if
// any.
func (p *fetchPositions) run(ctx context.Context, f *flight) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.timeout)
	f.tok, f.err = p.read(rctx, f)
	cancel()
	p.met.read(ctx, f.err)
	p.mu.Lock()
	if p.open == f { // the read failed before its query
		p.open = nil
	}
	nf := p.open
	p.busy = nf != nil
	p.mu.Unlock()
	close(f.done)
	if nf != nil {
		// Jobs that arrived after f was sealed; nf stays open to more
		// until its own query goes out.
		go p.run(context.WithoutCancel(ctx), nf)
	}
}

func (p *fetchPositions) read(ctx context.Context, f *flight) (position.Token, error) {
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return position.Token{}, err
	}
	defer conn.Release()
	// Let the rest of a fetched batch, runnable now, arrive and join
	// before the query goes out.
	runtime.Gosched()
	p.seal(f)
	// The jobs committed and waiting now get the position too (see
	// visibleJobs), if the scan returns before the position is read; a
	// failed scan costs only that.
	var scanned visibleScanned
	if v, client := p.visible.of(ctx); v != nil {
		scanned, _ = v.scan(ctx, client)
	}
	tok, err := p.capture.Capture(ctx, conn.Conn())
	if err == nil && len(scanned.ids) > 0 {
		scanned.register(tok)
		go p.flushTo(context.WithoutCancel(ctx), tok)
	}
	return tok, err
}

// flushTo makes the primary flush its WAL up to tok's position, if it has
// not yet, so that replicas can replay it now. The insert position
// (design notes, fact 1) may be past the flushed WAL: records no commit
// has flushed yet, such as the pruning and hint bits a scan of River's
// table writes after a DELETE. A walsender sends only flushed WAL, so
// without a commit elsewhere the replicas would reach the position only
// at the WAL writer's next round (wal_writer_delay, 200ms by default), and
// every job routed by it would wait that long (measured: 40–200ms for a
// backlog's first batch). Here, only when the flush position is behind,
// one statement commits a transaction that writes a record (a
// transactional logical decoding message, prefix "caughtup", which
// pgoutput forwards only to subscribers that ask for messages) under
// synchronous_commit on: RecordTransactionCommit flushes the WAL up to its
// commit record only for a transaction that wrote WAL (one that only took
// an xid commits asynchronously). Done for reads whose scan registered
// jobs (visibleJobs): their position serves many jobs. It changes no
// token; a failure (a role without EXECUTE on pg_logical_emit_message)
// leaves the flush to the server.
func (p *fetchPositions) flushTo(ctx context.Context, tok position.Token) {
	e, ok := tok.Entry(p.capture.Database())
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()
	_, _ = p.pool.Exec(ctx, `DO $$BEGIN
	IF pg_current_wal_flush_lsn() < '`+e.LSN.String()+`'::pg_lsn THEN
		PERFORM set_config('synchronous_commit', 'on', true);
		PERFORM pg_logical_emit_message(true, 'caughtup', 'flush');
	END IF;
END$$`, pgx.QueryExecModeSimpleProtocol) // a literal per call: nothing to prepare
}

// readAhead scans v's table and reads the position, as read does, off
// any job's path: through a backlog, the jobs behind those registered are
// registered before they are fetched, so that no fetch waits for a read
// (visibleJobs.startAhead says when). The caller marked it under way.
func (p *fetchPositions) readAhead(ctx context.Context, v *visibleJobs, client *riverClient) {
	defer v.endAhead()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.timeout)
	defer cancel()
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return
	}
	defer conn.Release()
	scanned, err := v.scan(ctx, client)
	if err != nil || len(scanned.ids) == 0 {
		return
	}
	tok, err := p.capture.Capture(ctx, conn.Conn())
	p.met.read(ctx, err)
	if err == nil {
		scanned.register(tok)
	}
}
