package caughtupkgo

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/caughtup/caughtup/internal/retry"
	"github.com/caughtup/caughtup/kafka"
)

// ErrRunning is returned by Run while another Run of the same Consumer is
// still going (kafka.ErrRunning, the same in both Kafka adapters).
var ErrRunning = kafka.ErrRunning

// Handler processes one record. The Consumer calls it with a context
// routed by its Router: consume.DB and consume.SQLDB return the pool
// chosen for the record, and jobs the handler enqueues inherit the
// record's token. ctx is cancelled when the consumer stops or the
// partition is revoked or lost; the record is then delivered again, here
// or to another member, so a handler must be idempotent (at-least-once)
// and should return promptly once ctx ends.
//
// A handler may return a *consume.DeferError of its own (from routing a
// second token, say): the Consumer treats it as its own deferrals (Mode).
type Handler func(ctx context.Context, r *kgo.Record) error

// Consumer reads a topic in a consumer group with a franz-go client and
// hands each record to a handler, one worker per assigned partition, each
// partition in order. One poll loop hands polled records to the
// partitions' queues and never waits for a handler; a partition whose
// head record waits for a replica has its fetches paused
// (kgo.Client.PauseFetchPartitions) until the record is done, so it holds
// back only itself (awaitRoom says when the loop polls).
//
// A record's offset is committed only once it and every record before it
// in its partition are done (handled, produced to the retry topic or
// dead-lettered), so nothing is lost on a crash; what was done since the
// last commit is delivered again (at-least-once). On a revocation the
// revoked partitions' workers are stopped, their queues dropped and what
// they finished committed before franz-go hands them on; on a loss the
// same without the commit.
type Consumer struct {
	cfg ConsumerConfig
	eng *kafka.Engine[*kgo.Record, kgo.RecordHeader]
	log *slog.Logger

	client atomic.Pointer[kgo.Client]

	// runCtx is the context of the current Run; partitions' workers derive
	// theirs from it. Set before the client exists.
	runCtx context.Context

	mu    sync.Mutex
	parts map[partKey]*partition
	// room (one slot) is signalled when a partition may want records: its
	// worker took its queue or stopped holding, or partitions came or went.
	room chan struct{}
}

// enginePartition is a partition's worker in the engine.
type enginePartition = kafka.Partition[*kgo.Record, kgo.RecordHeader]

// stopTimeout bounds the commit of a revocation and the end of Run (the
// last commit, leaving the group): a broker that cannot be reached costs
// redeliveries, not a stuck rebalance or shutdown.
const stopTimeout = 10 * time.Second

type partKey struct {
	topic string
	id    int32
}

// NewConsumer validates cfg and returns a Consumer that routes each
// record with cfg.Router and runs h with the routed context. It does not
// connect; Run does. A nil handler or Router is an ErrInvalidConfig.
func NewConsumer(cfg ConsumerConfig, h Handler) (*Consumer, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.ClientOpts = append([]kgo.Opt(nil), cfg.ClientOpts...)
	c := &Consumer{cfg: cfg}
	var err error
	c.eng, err = kafka.New(cfg.shared(), kafka.Adapter[*kgo.Record, kgo.RecordHeader]{
		Name: "caughtup/kgo", Scope: ScopeName, Client: client{c}, Handler: h,
	})
	if err != nil {
		return nil, err
	}
	c.log = c.eng.Logger()
	return c, nil
}

// topics is what the group subscribes to.
func (c *Consumer) topics() []string { return c.eng.Config().Topics() }

// Config returns the consumer's configuration with defaults applied.
func (c *Consumer) Config() ConsumerConfig { return c.cfg }

// Client returns the franz-go client of the current Run, nil when the
// Consumer is not running. Use it to inspect (PauseFetchPartitions with no
// arguments lists the paused partitions) or to produce; do not poll,
// commit, pause or resume with it: the Consumer does.
func (c *Consumer) Client() *kgo.Client { return c.client.Load() }

// Run joins the consumer group and consumes until ctx ends. Then it stops
// the partitions' workers (cancelling running handlers), commits what is
// done, leaves the group and closes its client, and returns nil. It
// returns an error only if the client cannot be created. A Consumer may
// Run again after Run returned.
func (c *Consumer) Run(ctx context.Context) error {
	ctx, end, err := c.eng.Begin(ctx)
	if err != nil {
		return err
	}
	defer end()
	c.runCtx = ctx
	c.parts = make(map[partKey]*partition)
	c.room = make(chan struct{}, 1)

	opts := append(append([]kgo.Opt(nil), c.cfg.ClientOpts...),
		kgo.ConsumerGroup(c.cfg.GroupID),
		kgo.ConsumeTopics(c.topics()...),
		kgo.DisableAutoCommit(),
		// Polls hand records to the queues and return: blocking
		// rebalances while they do keeps a revoked partition's records
		// from reaching a queue after its revocation was handled.
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsAssigned(c.onAssigned),
		kgo.OnPartitionsRevoked(c.onRevoked),
		kgo.OnPartitionsLost(c.onLost),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("caughtup/kgo: %w", err)
	}
	c.client.Store(cl)
	defer c.client.Store(nil)

	committerDone := make(chan struct{})
	go func() {
		defer close(committerDone)
		c.eng.CommitEvery(ctx, func() []*enginePartition { return works(c.snapshot()) }, c.committer(cl))
	}()

	c.poll(ctx, cl)

	// ctx has ended: every worker's context with it. Commit what they
	// finished, then leave the group (its final revocation commits again,
	// finding nothing new).
	<-committerDone
	c.stopAll()
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	defer scancel()
	c.eng.Commit(sctx, works(c.snapshot()), c.committer(cl))
	cl.AllowRebalance()
	// Leaving waits for the final revocation; bounded, so that a broker
	// that cannot be reached does not hold Run forever.
	if err := cl.LeaveGroupContext(sctx); err != nil {
		c.log.InfoContext(ctx, "caughtup/kgo: leaving the group failed; the coordinator expires this member after its session timeout",
			slog.String("group", c.cfg.GroupID), slog.Any("error", err))
	}
	cl.Close()
	c.mu.Lock()
	left := c.parts
	c.parts = nil
	c.mu.Unlock()
	for _, p := range left {
		p.stop()
		p.work.Flush(ctx)
	}
	return nil
}

// poll hands every polled record to its partition's queue until ctx ends
// or the client is closed. It never waits for a worker.
func (c *Consumer) poll(ctx context.Context, cl *kgo.Client) {
	for fails := 0; ctx.Err() == nil; {
		drain, ok := c.awaitRoom(ctx)
		if !ok {
			return
		}
		limit := c.cfg.MaxPollRecords
		if drain {
			limit = -1 // everything buffered
		}
		fetches := cl.PollRecords(ctx, limit)
		if fetches.IsClientClosed() || ctx.Err() != nil {
			cl.AllowRebalance()
			return
		}
		failed := false
		fetches.EachError(func(topic string, part int32, err error) {
			failed = true
			c.log.WarnContext(ctx, "caughtup/kgo: fetching failed; franz-go retries",
				slog.String("topic", topic), slog.Int("partition", int(part)), slog.Any("error", err))
		})
		fetches.EachPartition(func(ftp kgo.FetchTopicPartition) {
			if len(ftp.Records) > 0 {
				c.partition(ftp.Topic, ftp.Partition).push(ftp.Records)
			}
		})
		if drain {
			c.pauseFull()
		}
		cl.AllowRebalance()
		if failed {
			// Errors without records come back at once; do not spin on
			// them.
			fails++
			if !retry.Sleep(ctx, retry.Nth(fails, 100*time.Millisecond, 5*time.Second)) {
				return
			}
		} else {
			fails = 0
		}
	}
}

// slowAfter is how long the poll loop waits for a full partition while
// another partition's worker is idle with nothing queued, before it
// drains franz-go's buffer and pauses the full one. Short, because an
// idle worker is throughput lost (a handler that queries leaves three of
// four partitions idle behind one full queue for as long as this lasts),
// and a fast worker takes its full queue well within it, so ordinary
// flow is not paused.
const slowAfter = 5 * time.Millisecond

// awaitRoom waits until the partitions want more records (wantRecords),
// and reports false if ctx ended first. Waiting here, rather than polling
// and pausing, leaves the records in franz-go's buffer: it fetches no more
// from a broker until its buffered fetch has been polled, which is the
// backpressure franz-go expects and costs nothing to undo.
//
// A partition that stays full for slowAfter while another one starves
// must not hold that one up: its worker is the slower one. Then awaitRoom
// reports drain: the loop polls everything franz-go has buffered, which
// holds the starving partition's records (a poll returns a fetch's
// records partition by partition, so a bounded poll may return only the
// full partition's), and pauses the partitions it filled to QueueCapacity
// or beyond (pauseFull), so that nothing more is fetched for them until
// their workers take their queues. A queue may so hold what one fetch
// returned for its partition beyond QueueCapacity; those records were in
// memory already, in franz-go's buffer. Pausing a partition first, with
// records of it still buffered, would throw them away (franz-go drops
// what it buffered for a paused partition, to fetch and decode it again
// on resume): with a point query per record, franz-go's fetching took
// 11% of the process's CPU that way, against 2% for a plain consumer
// reading the same topic, and 2% now (BenchmarkThroughputQuery).
func (c *Consumer) awaitRoom(ctx context.Context) (drain, ok bool) {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		want, full := c.wantRecords()
		if want {
			return false, true
		}
		var slow <-chan time.Time
		if len(full) > 0 {
			if timer == nil {
				timer = time.NewTimer(slowAfter)
			}
			slow = timer.C
		}
		select {
		case <-c.room:
		case <-slow:
			return true, true
		case <-ctx.Done():
			return false, false
		}
	}
}

// pauseFull pauses the fetches of partitions whose queues hold
// QueueCapacity records or more, after a poll that took everything
// franz-go had buffered (awaitRoom).
func (c *Consumer) pauseFull() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.parts {
		p.mu.Lock()
		if len(p.queue) >= c.cfg.QueueCapacity {
			p.pauseLocked()
		}
		p.mu.Unlock()
	}
}

// wantRecords reports whether to poll: no partition that is not paused
// holds QueueCapacity records or more, and some holds less than half of
// it (or none is unpaused). When a full partition is what keeps it from
// polling while another one's worker is idle with nothing queued, it
// returns the full ones. A worker busy with the batch it took is not
// idle, though its queue is empty: it wants no records yet.
func (c *Consumer) wantRecords() (want bool, full []*partition) {
	c.mu.Lock()
	defer c.mu.Unlock()
	low, high := c.cfg.QueueCapacity/2, c.cfg.QueueCapacity
	unpaused, hungry, starving := false, false, false
	for _, p := range c.parts {
		p.mu.Lock()
		n, paused, idle := len(p.queue), p.paused, p.idle
		p.mu.Unlock()
		if paused {
			continue
		}
		unpaused = true
		switch {
		case n >= high:
			full = append(full, p)
		case n == 0:
			starving, hungry = starving || idle, true
		case n < low:
			hungry = true
		}
	}
	if len(full) > 0 {
		if !starving {
			full = nil
		}
		return false, full
	}
	return hungry || !unpaused, nil
}

// signalRoom wakes the poll loop if it waits for a partition to want
// records.
func (c *Consumer) signalRoom() {
	select {
	case c.room <- struct{}{}:
	default:
	}
}

// partition returns the state of a partition, starting its worker if it
// has none: franz-go fetches only assigned partitions, so this is an
// assignment that onAssigned has not seen (or a partition it started and
// polls refilled). Records polled for a partition are never dropped while
// the partition is ours: the client's cursor has moved past them.
func (c *Consumer) partition(topic string, id int32) *partition {
	k := partKey{topic, id}
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.parts[k]
	if p == nil {
		p = c.newPartition(k)
		c.parts[k] = p
	}
	return p
}

func (c *Consumer) onAssigned(_ context.Context, _ *kgo.Client, assigned map[string][]int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.parts == nil {
		return
	}
	for topic, ids := range assigned {
		for _, id := range ids {
			k := partKey{topic, id}
			if c.parts[k] == nil {
				c.parts[k] = c.newPartition(k)
			}
		}
	}
	c.signalRoom()
}

// onRevoked stops the revoked partitions' workers (cancelling their
// handlers: an unfinished record stays uncommitted and goes to the next
// owner), commits what they finished while this member still owns them,
// and forgets them, their queues and their pauses. franz-go waits for it
// before the group moves on, and with BlockRebalanceOnPoll no poll runs
// meanwhile, so nothing of these partitions reaches a queue afterwards.
func (c *Consumer) onRevoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	parts := c.detach(revoked)
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	c.eng.Commit(cctx, works(parts), c.committer(cl))
	cancel()
	c.forget(ctx, cl, parts)
	if c.cfg.OnRevoked != nil {
		c.cfg.OnRevoked(ctx, cl, revoked)
	}
}

// onLost is onRevoked without the commit: the partitions may already be
// someone else's, and their offsets are not ours to commit.
func (c *Consumer) onLost(ctx context.Context, cl *kgo.Client, lost map[string][]int32) {
	c.forget(ctx, cl, c.detach(lost))
	if c.cfg.OnLost != nil {
		c.cfg.OnLost(ctx, cl, lost)
	}
}

// detach removes the partitions from the consumer and stops their
// workers.
func (c *Consumer) detach(tps map[string][]int32) []*partition {
	var parts []*partition
	c.mu.Lock()
	for topic, ids := range tps {
		for _, id := range ids {
			k := partKey{topic, id}
			if p := c.parts[k]; p != nil {
				delete(c.parts, k)
				parts = append(parts, p)
			}
		}
	}
	c.mu.Unlock()
	for _, p := range parts {
		p.cancel()
	}
	for _, p := range parts {
		<-p.stopped
	}
	c.signalRoom()
	return parts
}

// forget clears the pauses of stopped partitions (franz-go keeps a pause
// until it is resumed, even across a reassignment, which would never
// fetch the partition again) and counts what they did.
func (c *Consumer) forget(ctx context.Context, cl *kgo.Client, parts []*partition) {
	resume := map[string][]int32{}
	for _, p := range parts {
		resume[p.key.topic] = append(resume[p.key.topic], p.key.id)
		p.work.Flush(ctx)
	}
	if len(resume) > 0 {
		cl.ResumeFetchPartitions(resume)
	}
}

// stopAll stops every worker and waits for them.
func (c *Consumer) stopAll() {
	c.mu.Lock()
	parts := make([]*partition, 0, len(c.parts))
	for _, p := range c.parts {
		parts = append(parts, p)
	}
	c.mu.Unlock()
	for _, p := range parts {
		p.stop()
	}
}

// snapshot returns the current partitions.
func (c *Consumer) snapshot() []*partition {
	c.mu.Lock()
	defer c.mu.Unlock()
	parts := make([]*partition, 0, len(c.parts))
	for _, p := range c.parts {
		parts = append(parts, p)
	}
	return parts
}

// works returns the engine's workers of parts.
func works(parts []*partition) []*enginePartition {
	ws := make([]*enginePartition, len(parts))
	for i, p := range parts {
		ws[i] = p.work
	}
	return ws
}

// committer is the kafka.Committer of cl: offsets with their leader
// epochs, committed with the group's generation (CommitOffsetsSync), so
// that once the group has moved on the coordinator refuses them and a
// member never commits a partition it lost.
func (c *Consumer) committer(cl *kgo.Client) kafka.Committer {
	return func(ctx context.Context, offsets []kafka.Offset) (refused map[kafka.TopicPartition]error, err error) {
		m := map[string]map[int32]kgo.EpochOffset{}
		for _, o := range offsets {
			if m[o.Topic] == nil {
				m[o.Topic] = map[int32]kgo.EpochOffset{}
			}
			m[o.Topic][o.Partition] = kgo.EpochOffset{Epoch: o.LeaderEpoch, Offset: o.Offset}
		}
		cl.CommitOffsetsSync(ctx, m, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, cerr error) {
			if err = cerr; err != nil {
				return
			}
			for _, t := range resp.Topics {
				for _, pr := range t.Partitions {
					if perr := kerr.ErrorForCode(pr.ErrorCode); perr != nil {
						if refused == nil {
							refused = map[kafka.TopicPartition]error{}
						}
						refused[kafka.TopicPartition{Topic: t.Topic, Partition: pr.Partition}] = perr
					}
				}
			}
		})
		return refused, err
	}
}
