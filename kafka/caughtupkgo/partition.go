package caughtupkgo

import (
	"context"
	"sync"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/kafka"
)

// partition is one assigned partition: the queue of records polled for
// it, in offset order, and the worker that processes them one at a time.
//
// Waiting in place is pausing: while the worker holds a record for a
// replica (or a handler's backoff), or while its queue is full
// (Consumer.poll), the partition's fetches are paused, so that franz-go neither fetches nor
// buffers more of it and the poll loop keeps serving the other
// partitions. Records already polled stay in the queue, in order, behind
// the one held; none is skipped, because the client's cursor has moved
// past them and only this queue still has them.
type partition struct {
	c      *Consumer
	key    partKey
	ctx    context.Context
	cancel context.CancelFunc
	// stopped is closed when the worker has returned.
	stopped chan struct{}
	// work is the partition's worker in the engine, reading this
	// partition as its kafka.Source.
	work *enginePartition

	mu      sync.Mutex
	queue   []*kgo.Record
	paused  bool          // our pause of its fetches is on
	holding bool          // the worker holds its head record
	wake    chan struct{} // one slot: records were queued

	// The worker's alone: the batch it took and the next record of it.
	batch []*kgo.Record
	next  int
}

var _ kafka.Source[*kgo.Record] = (*partition)(nil)

// newPartition starts a partition's worker. Called with c.mu held.
func (c *Consumer) newPartition(k partKey) *partition {
	ctx, cancel := context.WithCancel(c.runCtx)
	p := &partition{c: c, key: k, ctx: ctx, cancel: cancel, stopped: make(chan struct{}), wake: make(chan struct{}, 1)}
	p.work = c.eng.NewPartition(k.topic, k.id, p)
	go func() {
		defer close(p.stopped)
		p.work.Run(p.ctx)
	}()
	return p
}

// stop cancels the worker and waits for it.
func (p *partition) stop() {
	p.cancel()
	<-p.stopped
}

// push appends polled records. The poll loop bounds the queue
// (Consumer.poll): it pauses the partition's fetches once its queue
// reaches QueueCapacity.
func (p *partition) push(rs []*kgo.Record) {
	p.mu.Lock()
	p.queue = append(p.queue, rs...)
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// take returns the queued records and empties the queue, waiting for
// some if there are none; nil once the worker's context has ended.
// Taking the queue makes room, so a pause for a full queue ends here.
func (p *partition) take(prev []*kgo.Record) []*kgo.Record {
	for {
		p.mu.Lock()
		if len(p.queue) > 0 {
			batch := p.queue
			p.queue = prev[:0]
			if !p.holding {
				p.resumeLocked()
			}
			p.mu.Unlock()
			p.c.signalRoom()
			return batch
		}
		p.mu.Unlock()
		select {
		case <-p.wake:
		case <-p.ctx.Done():
			return nil
		}
	}
}

// Next returns the next record of the batch the worker took, taking the
// queue when the batch is done; false once the worker's context has
// ended. A record done is let go of at once.
func (p *partition) Next(context.Context) (*kgo.Record, bool) {
	if p.next > 0 {
		p.batch[p.next-1] = nil
	}
	if p.next == len(p.batch) {
		b := p.take(p.batch)
		if b == nil {
			return nil, false
		}
		p.batch, p.next = b, 0
	}
	r := p.batch[p.next]
	p.next++
	return r, true
}

// Pause marks the worker as holding its head record for a while (a
// deferral or a retry backoff in place) and pauses the partition's
// fetches meanwhile.
func (p *partition) Pause() {
	p.mu.Lock()
	if !p.holding {
		p.holding = true
		p.pauseLocked()
	}
	p.mu.Unlock()
}

// Resume ends a hold; fetches resume unless the queue is still full.
func (p *partition) Resume() {
	p.mu.Lock()
	if !p.holding {
		p.mu.Unlock()
		return
	}
	p.holding = false
	if len(p.queue) < p.c.cfg.QueueCapacity {
		p.resumeLocked()
	}
	p.mu.Unlock()
	p.c.signalRoom()
}

func (p *partition) pauseLocked() {
	if p.paused || p.ctx.Err() != nil {
		return
	}
	if cl := p.c.client.Load(); cl != nil {
		cl.PauseFetchPartitions(map[string][]int32{p.key.topic: {p.key.id}})
		p.paused = true
	}
}

func (p *partition) resumeLocked() {
	if !p.paused {
		return
	}
	// A stopped partition's pause is cleared by Consumer.forget, after
	// the worker has returned: resuming here could let a revoked
	// partition's fetches run again before franz-go has dropped it.
	if p.ctx.Err() != nil {
		return
	}
	if cl := p.c.client.Load(); cl != nil {
		cl.ResumeFetchPartitions(map[string][]int32{p.key.topic: {p.key.id}})
		p.paused = false
	}
}
