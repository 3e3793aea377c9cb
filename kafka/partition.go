package kafka

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
)

// Source is one assigned partition's records as the adapter's client
// fetches them, in offset order.
type Source[R any] interface {
	// Next returns the partition's next record, waiting for one; false
	// once ctx has ended (or the partition is gone).
	Next(ctx context.Context) (R, bool)
	// Pause is called when the worker starts holding its head record (a
	// deferral in place, a retry backoff, a retry-topic record not due
	// yet), Resume once the record is done: a client that fetches for
	// many partitions stops fetching this one meanwhile, so that it
	// neither buffers more of it nor holds up the others. A client whose
	// worker fetches for itself (a reader per partition) does nothing:
	// not reading is pausing.
	Pause()
	Resume()
}

// Partition is one assigned partition's worker (Run) and what it keeps
// from record to record: the offset done, for the committer, and its
// counts. At hundreds of thousands of records a second what a record
// costs besides its handler is mostly bookkeeping, so the worker does it
// in bulk or reuses it:
//
//   - its results and the router's decisions (consume.Tally) are counted
//     here and added to the instruments (caughtup.kafka.messages,
//     consume's caughtup.consume.decisions and the rest) by Flush, which
//     the adapter calls at every commit and once the worker has stopped:
//     an OpenTelemetry SDK Add costs a few hundred nanoseconds, a record
//     would pay three;
//   - tokens are decoded by a position.HeaderDecoder, which allocates
//     nothing per record and decodes a run of records with the same
//     header (a batch of one transaction's events, an outbox relay's
//     batch stamped with one position) once.
type Partition[R any, H Header] struct {
	e     *Engine[R, H]
	topic string
	id    int32
	src   Source[R]
	// retry: a retry topic's partition, whose records carry a due time.
	retry bool

	// done is the offset after the last record done, in order, and
	// doneEpoch its leader epoch; -1 until one is. Written by the worker
	// (epoch first), read by the committer. A commit that reads a newer
	// epoch with an older offset is harmless: the epoch only lets the next
	// owner detect a truncated log, and a newer epoch's range covers the
	// older offset.
	done      atomic.Int64
	doneEpoch atomic.Int32
	committed atomic.Int64

	topicCounter *topicCounter
	tally        *consume.Tally
	results      [numResults]atomic.Int64

	// The worker's alone. The token dec returns is valid until the next
	// record's: the Router keeps nothing of the tokens it routes.
	dec   position.HeaderDecoder
	held  bool  // src is paused for the record at hand
	epoch int32 // doneEpoch as last stored
	// traced: Run's context has a span of its own, which its records'
	// routing and handlers join (traceContext); read once per Run.
	traced bool
}

// NewPartition returns the worker of partition id of topic, reading src.
// Run it on a goroutine of its own.
func (e *Engine[R, H]) NewPartition(topic string, id int32, src Source[R]) *Partition[R, H] {
	p := &Partition[R, H]{e: e, topic: topic, id: id, src: src,
		retry:        e.cfg.Mode == RetryTopic && topic == e.cfg.RetryTopic,
		topicCounter: e.met[topic], tally: e.cfg.Router.NewTally()}
	if p.topicCounter == nil {
		// Not a topic the group subscribes to; count it under the main
		// topic's name rather than not at all.
		p.topicCounter = e.met[e.cfg.Topic]
	}
	p.done.Store(-1)
	p.doneEpoch.Store(-1)
	p.epoch = -1
	p.committed.Store(-1)
	return p
}

// Topic and ID name the partition.
func (p *Partition[R, H]) Topic() string { return p.topic }
func (p *Partition[R, H]) ID() int32     { return p.id }

// Run processes the partition's records one at a time, in offset order,
// until ctx ends or Next reports none. A record is done once it was
// handled, republished or dead-lettered; one that ctx ended first stays
// undone (uncommitted, delivered again) and Run returns.
func (p *Partition[R, H]) Run(ctx context.Context) {
	p.traced = trace.SpanContextFromContext(ctx).IsValid()
	for {
		r, ok := p.src.Next(ctx)
		if !ok {
			return
		}
		if !p.e.process(ctx, r, p) {
			p.add(resultDropped)
			pl := p.e.lib.Place(r)
			p.e.log.DebugContext(ctx, p.e.name+": record dropped before it was done; it will be delivered again",
				slog.String("topic", pl.Topic), slog.Int("partition", int(pl.Partition)), slog.Int64("offset", pl.Offset))
			return
		}
		pl := p.e.lib.Place(r)
		if pl.LeaderEpoch != p.epoch {
			// Epochs change at leader elections: storing one per record
			// would cost an atomic write to say nothing new.
			p.epoch = pl.LeaderEpoch
			p.doneEpoch.Store(pl.LeaderEpoch)
		}
		p.done.Store(pl.Offset + 1)
	}
}

// hold pauses the partition's Source while the worker holds its record;
// process resumes it once the record is done.
func (p *Partition[R, H]) hold() {
	if !p.held {
		p.held = true
		p.src.Pause()
	}
}

func (p *Partition[R, H]) add(r result) { p.results[r].Add(1) }

// Flush adds what the partition counted since the last Flush to the
// instruments. ctx's values (not its cancellation) go to the instruments.
func (p *Partition[R, H]) Flush(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	for r := range numResults {
		if n := p.results[r].Swap(0); n > 0 {
			p.topicCounter.messages.Add(ctx, n, p.topicCounter.opts[r])
		}
	}
	p.tally.Flush(ctx)
}

// Offset is what a commit says of one partition: the offset after its last
// record done in order, and that record's leader epoch (-1 if unknown).
type Offset struct {
	Topic       string
	Partition   int32
	Offset      int64
	LeaderEpoch int32
}

// TopicPartition names a partition.
type TopicPartition struct {
	Topic     string
	Partition int32
}

// Committer commits offsets for the group and waits for the coordinator.
// err means nothing was committed; refused names the partitions the
// coordinator refused (the others were committed). Commits must carry the
// group's generation, so that the coordinator refuses them once the group
// has moved on and a member never commits a partition it lost.
type Committer func(ctx context.Context, offsets []Offset) (refused map[TopicPartition]error, err error)

// Commit commits, through commit, the done offsets of parts that moved
// since their last commit. A failed commit is logged with attrs (slog
// key-value pairs); the next owner then starts from the last successful
// one and does the rest again.
func (e *Engine[R, H]) Commit(ctx context.Context, parts []*Partition[R, H], commit Committer, attrs ...any) {
	var offsets []Offset
	var sent []*Partition[R, H]
	for _, p := range parts {
		o := p.done.Load()
		if o < 0 || o <= p.committed.Load() {
			continue
		}
		offsets = append(offsets, Offset{Topic: p.topic, Partition: p.id, Offset: o, LeaderEpoch: p.doneEpoch.Load()})
		sent = append(sent, p)
	}
	if len(sent) == 0 {
		return
	}
	refused, err := commit(ctx, offsets)
	// A fresh slice, full: appending to it never writes into attrs.
	args := append([]any{slog.String("group", e.cfg.GroupID)}, attrs...)
	args = args[:len(args):len(args)]
	if err != nil {
		e.log.InfoContext(ctx, e.name+": committing offsets failed; uncommitted records will be delivered again",
			append(args, slog.Any("error", err))...)
		return
	}
	for i, p := range sent {
		if err := refused[TopicPartition{p.topic, p.id}]; err != nil {
			e.log.InfoContext(ctx, e.name+": committing a partition's offset failed; uncommitted records will be delivered again",
				append(args, slog.String("topic", p.topic), slog.Int("partition", int(p.id)), slog.Any("error", err))...)
			continue
		}
		p.markCommitted(offsets[i].Offset)
	}
}

// markCommitted records a successful commit of offset o. Commits of one
// partition may overlap (the ticker's and a revocation's).
func (p *Partition[R, H]) markCommitted(o int64) {
	for {
		cur := p.committed.Load()
		if o <= cur || p.committed.CompareAndSwap(cur, o) {
			return
		}
	}
}

// CommitEvery commits the done offsets of parts() through commit and
// flushes their counts every CommitInterval until ctx ends. The last
// commit, once the workers have stopped, is the adapter's.
func (e *Engine[R, H]) CommitEvery(ctx context.Context, parts func() []*Partition[R, H], commit Committer, attrs ...any) {
	t := time.NewTicker(e.cfg.CommitInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			ps := parts()
			e.Commit(ctx, ps, commit, attrs...)
			for _, p := range ps {
				p.Flush(ctx)
			}
		case <-ctx.Done():
			return
		}
	}
}
