package caughtupriver

import (
	"context"
	"sync"
	"time"

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
// the read's query was sent. So a job never joins a read already under
// way (it may have started before this job's fetch returned): it waits for
// the next one, which starts as soon as the current one ends. Under load,
// one read serves every job that arrived during the previous read's round
// trip; an idle worker pays one round trip per job. No clock is compared:
// the order is the process's own (a mutex), so clock skew between the
// worker and the database cannot make a read look newer than a fetch.
type fetchPositions struct {
	pool    *pgxpool.Pool
	capture *enqueue.Capturer
	timeout time.Duration
	met     *metrics

	mu      sync.Mutex
	running bool    // a read is under way
	next    *flight // the read that jobs arriving now wait for; nil: none yet
}

// flight is one read of the primary's position and the jobs waiting for
// it.
type flight struct {
	done chan struct{}
	tok  position.Token
	err  error
}

// token returns the primary's position read by a query that started after
// token was called. ctx bounds only the wait: the read itself is shared
// and runs under its own timeout.
func (p *fetchPositions) token(ctx context.Context) (position.Token, error) {
	p.mu.Lock()
	if p.next == nil {
		p.next = &flight{done: make(chan struct{})}
	}
	f := p.next
	lead := !p.running
	if lead {
		p.running, p.next = true, nil
	}
	p.mu.Unlock()
	if lead {
		// The first job to arrive reads for itself and those who join
		// before the read starts (none: it starts now), so an idle worker
		// pays no goroutine.
		p.run(ctx, f)
	}
	select {
	case <-f.done:
		return f.tok, f.err
	case <-ctx.Done():
		return position.Token{}, ctx.Err()
	}
}

// run reads for f, then starts the read that jobs arrived meanwhile wait
// for, if any.
func (p *fetchPositions) run(ctx context.Context, f *flight) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.timeout)
	f.tok, f.err = p.read(rctx)
	cancel()
	p.met.read(ctx, f.err)
	close(f.done)
	p.mu.Lock()
	nf := p.next
	p.next = nil
	p.running = nf != nil
	p.mu.Unlock()
	if nf != nil {
		// Every job waiting for nf arrived before this point, after f's
		// query was sent; nf's query is sent after all of them arrived.
		go p.run(context.WithoutCancel(ctx), nf)
	}
}

func (p *fetchPositions) read(ctx context.Context) (position.Token, error) {
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return position.Token{}, err
	}
	defer conn.Release()
	return p.capture.Capture(ctx, conn.Conn())
}
