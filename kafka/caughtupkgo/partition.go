package caughtupkgo

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// partition is one assigned partition: the queue of records polled for
// it, in offset order, and the worker that processes them one at a time.
//
// Waiting in place is pausing: while the worker holds a record for a
// replica (or a handler's backoff), or while its queue stays full and
// another partition starves (Consumer.awaitRoom), the partition's
// fetches are paused, so that franz-go neither fetches nor
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

	mu      sync.Mutex
	queue   []*kgo.Record
	spare   []*kgo.Record // the worker's previous batch, reused
	paused  bool          // our pause of its fetches is on
	holding bool          // the worker holds its head record
	idle    bool          // the worker waits in take for records
	wake    chan struct{} // one slot: records were queued

	// done is the offset after the last record done, in order, and
	// doneEpoch its leader epoch; -1 until one is. Written by the worker
	// (epoch first), read by the committer. A commit that reads a newer
	// epoch with an older offset is harmless: the epoch only lets the next
	// owner detect a truncated log, and a newer epoch's range covers the
	// older offset.
	done      atomic.Int64
	doneEpoch atomic.Int32
	committed atomic.Int64

	counts *kafka.Counts
	// The worker's alone: decodes the token header of record after
	// record without allocating (position.HeaderDecoder).
	dec position.HeaderDecoder
}

// newPartition starts a partition's worker. Called with c.mu held.
func (c *Consumer) newPartition(k partKey) *partition {
	ctx, cancel := context.WithCancel(c.runCtx)
	p := &partition{
		c: c, key: k, ctx: ctx, cancel: cancel, stopped: make(chan struct{}),
		wake:   make(chan struct{}, 1),
		counts: &kafka.Counts{Topic: c.met[k.topic], Tally: c.cfg.Router.NewTally()},
	}
	if p.counts.Topic == nil {
		// Not a topic the group subscribes to; count it under the main
		// topic's name rather than not at all.
		p.counts.Topic = c.met[c.cfg.Topic]
	}
	p.done.Store(-1)
	p.committed.Store(-1)
	go p.run()
	return p
}

// stop cancels the worker and waits for it.
func (p *partition) stop() {
	p.cancel()
	<-p.stopped
}

// push appends polled records. The poll loop bounds the queue
// (Consumer.awaitRoom): it polls no more while a queue is full, and one
// poll adds at most MaxPollRecords.
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
			p.idle = false
			if !p.holding {
				p.resumeLocked()
			}
			p.mu.Unlock()
			p.c.signalRoom()
			return batch
		}
		wasIdle := p.idle
		p.idle = true
		p.mu.Unlock()
		if !wasIdle {
			p.c.signalRoom() // a full partition may now be what starves this one
		}
		select {
		case <-p.wake:
		case <-p.ctx.Done():
			return nil
		}
	}
}

// hold marks the worker as holding its head record for a while (a
// deferral or a retry backoff in place) and pauses the partition's
// fetches meanwhile.
func (p *partition) hold() {
	p.mu.Lock()
	if !p.holding {
		p.holding = true
		p.pauseLocked()
	}
	p.mu.Unlock()
}

// release ends a hold; fetches resume unless the queue is still full.
func (p *partition) release() {
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

// run processes the partition's records in order until its context ends.
func (p *partition) run() {
	defer close(p.stopped)
	for {
		batch := p.take(p.spare)
		if batch == nil {
			return
		}
		for i, r := range batch {
			if !p.c.process(p.ctx, r, p) {
				p.counts.Add(kafka.Dropped)
				return
			}
			p.doneEpoch.Store(r.LeaderEpoch)
			p.done.Store(r.Offset + 1)
			batch[i] = nil
		}
		p.spare = batch
	}
}

// doneOffset is the offset to commit, if any record is done.
func (p *partition) doneOffset() (kgo.EpochOffset, bool) {
	o := p.done.Load()
	if o < 0 {
		return kgo.EpochOffset{}, false
	}
	return kgo.EpochOffset{Epoch: p.doneEpoch.Load(), Offset: o}, true
}

// markCommitted records a successful commit of offset o.
func (p *partition) markCommitted(o int64) {
	for {
		cur := p.committed.Load()
		if o <= cur || p.committed.CompareAndSwap(cur, o) {
			return
		}
	}
}
