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
// back only itself (poll says how the loop polls).
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
//
// Each poll takes everything franz-go has buffered, as a plain franz-go
// loop does (PollFetches), so that franz-go fetches the next records
// while the workers run these: fetches and workers overlap. A bounded
// poll (PollRecords of a few hundred) empties franz-go's buffer, whose
// records come partition by partition, only after many polls, and with
// small records the workers' queues would hold a few milliseconds of
// work against a fetch that takes tens to come back: the workers waited
// for it, and the machine's cores sat a third idle
// (BenchmarkThroughput). What bounds memory is the pause: a partition
// whose queue reaches QueueCapacity has its fetches paused after the
// poll (pauseFull) until its worker takes its queue. Pausing before the
// poll has taken the partition's buffered records would have franz-go
// drop them, to fetch and decode them again on resume.
func (c *Consumer) poll(ctx context.Context, cl *kgo.Client) {
	for fails := 0; ctx.Err() == nil; {
		if !c.awaitRoom(ctx) {
			return
		}
		fetches := cl.PollRecords(ctx, -1)
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
		c.pauseFull()
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

// awaitRoom waits until some partition wants more records (wantRecords),
// and reports false if ctx ended first. While none does, records wait in
// franz-go's buffer, which it fills no further until it has been polled:
// the backpressure franz-go expects, which costs nothing to undo.
func (c *Consumer) awaitRoom(ctx context.Context) bool {
	for !c.wantRecords() {
		select {
		case <-c.room:
		case <-ctx.Done():
			return false
		}
	}
	return true
}

// pauseFull pauses the fetches of partitions whose queues hold
// QueueCapacity records or more, after a poll that took everything
// franz-go had buffered: nothing of theirs is left there to drop.
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

// wantRecords reports whether to poll: some partition that is not paused
// holds less than half of QueueCapacity (its worker will want records
// soon), or none is unpaused (a poll then waits for assignments, or for a
// partition to resume).
func (c *Consumer) wantRecords() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	low := c.cfg.QueueCapacity / 2
	unpaused := false
	for _, p := range c.parts {
		p.mu.Lock()
		n, paused := len(p.queue), p.paused
		p.mu.Unlock()
		if paused {
			continue
		}
		if n < low {
			return true
		}
		unpaused = true
	}
	return !unpaused
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
