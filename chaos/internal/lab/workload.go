package lab

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/enqueue"
)

// sink is one way a job leaves the producer: an enqueue into one queue or
// topic, consumed by the given streams (a Kafka topic read by three
// consumer groups feeds three streams with one write).
type sink struct {
	send func(ctx context.Context, p payload) error
	// sendTx, set instead of send, enqueues inside the write's own
	// transaction (River's InsertTx): the job commits with the row and
	// carries no token. Its payload's Committed and Enqueued are when it
	// was inserted, just before the COMMIT; delay does not apply.
	sendTx  func(ctx context.Context, tx pgx.Tx, p payload) error
	streams []*stream
}

// lane is where a share of the jobs goes: the asynq pipeline or the Kafka
// pipeline. Jobs alternate between lanes.
type lane struct {
	name  string
	sinks []sink
	jobs  atomic.Int64
}

// workload is the producers: each job writes its row on the primary in
// its own transaction, takes the token enqueue.InTx captured after the
// commit, and enqueues through the adapter's stamping client or writer.
type workload struct {
	pool  *pgxpool.Pool
	lanes []*lane
	jobs  int
	over  time.Duration // production is spread over this span
	// workers write concurrently; several producers are what makes
	// concurrent commits and out-of-order tokens.
	workers int
	keys    int64
	// delay, if set, is how long after the commit a job is enqueued
	// (a job scheduled for later, or an event relayed late).
	delay func(r *rand.Rand) time.Duration
	// idBase and keyBase offset job ids and row keys, so that a second
	// producer of one scenario uses ids and rows of its own.
	idBase, keyBase int64
	// gate, if set, is held for reading around each write (transaction
	// and position capture): a fault that takes it for writing stops new
	// writes and waits for those under way.
	gate *sync.RWMutex

	writeRetries, sendRetries atomic.Int64
	writeNanos, sendNanos     atomic.Int64
	produced                  atomic.Int64
}

// run produces every job, retrying writes and enqueues until they succeed
// or ctx ends, and returns once the last enqueue returned.
func (w *workload) run(ctx context.Context) {
	ids := make(chan int64)
	var wg, delayed sync.WaitGroup
	for i := range w.workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(i)))
			for id := range ids {
				w.one(ctx, rng, id, &delayed)
			}
		})
	}
	start := time.Now()
	interval := w.over / time.Duration(max(w.jobs, 1))
	for i := range w.jobs {
		if d := time.Until(start.Add(time.Duration(i) * interval)); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
			}
		}
		if ctx.Err() != nil {
			break
		}
		select {
		case ids <- w.idBase + int64(i+1):
		case <-ctx.Done():
		}
	}
	close(ids)
	wg.Wait()
	delayed.Wait()
}

func (w *workload) one(ctx context.Context, rng *rand.Rand, id int64, delayed *sync.WaitGroup) {
	l := w.lanes[int(id%int64(len(w.lanes)))]
	key := w.keyBase + 1 + rng.Int64N(w.keys)
	var (
		p, inTx payload
		tctx    context.Context
	)
	began := time.Now()
	for {
		var version int64
		var err error
		if w.gate != nil {
			w.gate.RLock()
		}
		tctx, err = enqueue.InTx(ctx, w.pool, func(tx pgx.Tx) error {
			if err := tx.QueryRow(ctx, `INSERT INTO items (id, version) VALUES ($1, 1)
				ON CONFLICT (id) DO UPDATE SET version = items.version + 1 RETURNING version`, key).Scan(&version); err != nil {
				return err
			}
			now := time.Now().UnixNano()
			inTx = payload{ID: id, Key: key, Version: version, Committed: now, Enqueued: now}
			return l.sendInTx(ctx, tx, inTx)
		})
		if w.gate != nil {
			w.gate.RUnlock()
		}
		if err == nil {
			p = payload{ID: id, Key: key, Version: version, Committed: time.Now().UnixNano()}
			break
		}
		// A failed COMMIT, or a commit whose position could not be read
		// (*enqueue.CaptureError with Committed), is written again: the
		// new version supersedes the old, and the job carries the new
		// write's token. Nothing is enqueued without a token. (A job
		// inserted in the transaction, sink.sendTx, is then in its queue
		// already, with the old version, and is judged by it; the job id
		// is complete once either job of it has run.)
		if ctx.Err() != nil {
			return
		}
		w.writeRetries.Add(1)
		sleepCtx(ctx, 50*time.Millisecond)
	}
	w.writeNanos.Add(int64(time.Since(began)))
	tok, _ := enqueue.TokenFrom(tctx)
	// Jobs inserted in the transaction exist from its commit; the token
	// captured after it is the lab's, for the catch-up latency (the job
	// carries none).
	for _, s := range l.sinks {
		if s.sendTx != nil {
			for _, st := range s.streams {
				st.addProduced(inTx, tok)
			}
		}
	}
	send := func() {
		sent := time.Now()
		defer func() { w.sendNanos.Add(int64(time.Since(sent))) }()
		for _, s := range l.sinks {
			if s.sendTx != nil {
				continue
			}
			for {
				p.Enqueued = time.Now().UnixNano()
				err := s.send(tctx, p)
				if err == nil {
					break
				}
				if ctx.Err() != nil {
					return
				}
				w.sendRetries.Add(1)
				sleepCtx(ctx, 100*time.Millisecond)
			}
			for _, st := range s.streams {
				st.addProduced(p, tok)
			}
		}
		l.jobs.Add(1)
		w.produced.Add(1)
	}
	if w.delay == nil {
		send()
		return
	}
	d := w.delay(rng)
	if d <= 0 {
		send()
		return
	}
	delayed.Go(func() {
		sleepCtx(ctx, d)
		send()
	})
}

// sendInTx enqueues through the lane's sinks that enqueue inside the
// write's transaction (sink.sendTx).
func (l *lane) sendInTx(ctx context.Context, tx pgx.Tx, p payload) error {
	for _, s := range l.sinks {
		if s.sendTx != nil {
			if err := s.sendTx(ctx, tx, p); err != nil {
				return err
			}
		}
	}
	return nil
}

// meanMS returns the mean write (transaction with capture) and enqueue
// times per job, in milliseconds.
func (w *workload) meanMS() (write, send float64) {
	n := float64(max(w.produced.Load(), 1))
	return float64(w.writeNanos.Load()) / n / 1e6, float64(w.sendNanos.Load()) / n / 1e6
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
