package caughtupkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/cdc"
	engine "github.com/caughtup/caughtup/kafka"
)

// ErrRunning is returned by Run while another Run of the same Consumer is
// still going (engine.ErrRunning, the same in both Kafka adapters).
var ErrRunning = engine.ErrRunning

// Consumer reads a topic in a consumer group and hands each message to a
// handler, one worker per assigned partition, each partition in order.
// A message's offset is committed only once it and every message before
// it in its partition are done (handled, republished or dead-lettered), so
// nothing is lost on a crash; what was processed since the last commit is
// delivered again (at-least-once).
//
// The Consumer uses kafka-go's ConsumerGroup directly rather than a group
// Reader: each generation's assigned partitions get their own
// partition Reader and worker goroutine, so a partition waiting for a
// replica holds back only itself, and commits carry the generation, so a
// revoked partition's offsets are never committed by a member that lost
// it. See the package documentation.
type Consumer struct {
	cfg ConsumerConfig
	eng *engine.Engine[*kafka.Message, kafka.Header]
	log *slog.Logger
	// w republishes, during a Run (Client.Produce).
	w MessageWriter

	// For TokenDebezium: the checker, and the router's clock and
	// staleness bound, which say whether its primary's epoch is current.
	checker   *cdc.Checker
	now       func() time.Time
	staleness time.Duration
}

// enginePartition is a partition's worker in the engine.
type enginePartition = engine.Partition[*kafka.Message, kafka.Header]

// NewConsumer validates cfg and returns a Consumer that routes each
// message with cfg.Router and runs h with the routed context. It does not
// connect; Run does. A nil handler or Router is an ErrInvalidConfig.
func NewConsumer(cfg ConsumerConfig, h Handler) (*Consumer, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Brokers = append([]string(nil), cfg.Brokers...)
	c := &Consumer{cfg: cfg}
	a := engine.Adapter[*kafka.Message, kafka.Header]{
		Name: "caughtup/kafka", Scope: ScopeName, Client: client{c},
		Handler: h.engine(),
	}
	if cfg.TokenFormat == TokenDebezium {
		var err error
		if c.checker = cfg.Debezium.Checker; c.checker == nil {
			if c.checker, err = cdc.NewChecker(cdc.Config{MeterProvider: cfg.MeterProvider}); err != nil {
				return nil, fmt.Errorf("caughtup/kafka: creating the CDC checker: %w", err)
			}
		}
		rc := cfg.Router.Config()
		c.now, c.staleness = rc.Now, rc.Tracker.StalenessBound
		a.Token = c.debeziumToken
	}
	var err error
	if c.eng, err = engine.New(cfg.shared(), a); err != nil {
		return nil, err
	}
	c.log = c.eng.Logger()
	return c, nil
}

// Config returns the consumer's configuration with defaults applied.
func (c *Consumer) Config() ConsumerConfig { return c.cfg }

// Run joins the consumer group and consumes until ctx ends. Then it stops
// fetching, cancels the contexts of running handlers, commits what is done,
// leaves the group and returns nil. Errors joining the group are logged
// and retried (kafka-go's JoinGroupBackoff); Run returns an error only if
// it cannot start. A Consumer may Run again after Run returned.
func (c *Consumer) Run(ctx context.Context) error {
	ctx, end, err := c.eng.Begin(ctx)
	if err != nil {
		return err
	}
	defer end()

	w, closeWriter := c.republisher()
	defer closeWriter()
	c.w = w

	cg, err := kafka.NewConsumerGroup(kafka.ConsumerGroupConfig{
		ID:                    c.cfg.GroupID,
		Brokers:               c.cfg.Brokers,
		Dialer:                c.cfg.Dialer,
		Topics:                c.topics(),
		GroupBalancers:        c.cfg.GroupBalancers,
		HeartbeatInterval:     c.cfg.HeartbeatInterval,
		SessionTimeout:        c.cfg.SessionTimeout,
		RebalanceTimeout:      c.cfg.RebalanceTimeout,
		JoinGroupBackoff:      c.cfg.JoinGroupBackoff,
		StartOffset:           c.cfg.StartOffset,
		WatchPartitionChanges: c.cfg.WatchPartitionChanges,
		ErrorLogger:           c.kafkaLogger(slog.LevelDebug),
	})
	if err != nil {
		return fmt.Errorf("caughtup/kafka: %w", err)
	}
	// Closing the group ends the current generation, which waits for every
	// partition worker and the final commit, then leaves the group.
	defer cg.Close()

	for {
		gen, err := cg.Next(ctx)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, kafka.ErrGroupClosed) {
				return nil
			}
			c.log.WarnContext(ctx, "caughtup/kafka: joining the consumer group failed; retrying",
				slog.String("group", c.cfg.GroupID), slog.Any("error", err))
			continue
		}
		c.startGeneration(ctx, gen)
	}
}

// topics is what the group subscribes to.
func (c *Consumer) topics() []string { return c.eng.Config().Topics() }

// generation is one generation's assigned partitions: their workers, each
// reading its own partition Reader, and one committer.
type generation struct {
	gen     *kafka.Generation
	parts   []*enginePartition
	workers sync.WaitGroup
}

func (c *Consumer) startGeneration(ctx context.Context, gen *kafka.Generation) {
	g := &generation{gen: gen}
	var readers []*reader
	for _, topic := range c.topics() {
		for _, a := range gen.Assignments[topic] {
			r := &reader{c: c, topic: topic, id: a.ID, start: a.Offset}
			readers = append(readers, r)
			g.parts = append(g.parts, c.eng.NewPartition(topic, int32(a.ID), r))
		}
	}
	if c.log.Enabled(ctx, slog.LevelDebug) {
		assigned := make([]string, len(readers))
		for i, r := range readers {
			assigned[i] = fmt.Sprintf("%s/%d@%d", r.topic, r.id, r.start)
		}
		c.log.DebugContext(ctx, "caughtup/kafka: generation started",
			slog.String("group", c.cfg.GroupID), slog.Int("generation", int(gen.ID)),
			slog.Any("partitions", assigned))
	}
	g.workers.Add(len(g.parts))
	for i, p := range g.parts {
		gen.Start(func(gctx context.Context) {
			defer g.workers.Done()
			c.runPartition(ctx, gctx, p, readers[i])
		})
	}
	gen.Start(func(gctx context.Context) { c.commitLoop(ctx, gctx, g) })
}

// runPartition runs one partition's worker over its own Reader until the
// generation or the consumer ends. The Reader, and with it every message
// it buffered, dies with the generation: nothing fetched under a revoked
// assignment is processed later (kafka-go issue #1398 concerns the group
// Reader's shared buffer, which this design does not have).
func (c *Consumer) runPartition(runCtx, gctx context.Context, p *enginePartition, r *reader) {
	ctx, cancel := context.WithCancel(runCtx)
	defer cancel()
	stop := context.AfterFunc(gctx, cancel)
	defer stop()
	if !r.open(ctx) {
		return
	}
	defer r.r.Close()
	p.Run(ctx)
}

// commitLoop commits done offsets every CommitInterval and, once the
// generation or the consumer ends, after every worker has stopped. Commits
// carry the generation: the coordinator rejects them once the group has
// moved on, so a partition this member lost is never committed by it.
func (c *Consumer) commitLoop(runCtx, gctx context.Context, g *generation) {
	ctx, cancel := context.WithCancel(runCtx)
	stop := context.AfterFunc(gctx, cancel)
	parts := func() []*enginePartition { return g.parts }
	c.eng.CommitEvery(ctx, parts, g.commit, slog.Int("generation", int(g.gen.ID)))
	stop()
	cancel()
	g.workers.Wait()
	c.eng.Commit(context.WithoutCancel(runCtx), g.parts, g.commit, slog.Int("generation", int(g.gen.ID)))
	for _, p := range g.parts {
		p.Flush(runCtx)
	}
}

// commit is the generation's engine.Committer.
func (g *generation) commit(_ context.Context, offsets []engine.Offset) (map[engine.TopicPartition]error, error) {
	m := make(map[string]map[int]int64)
	for _, o := range offsets {
		if m[o.Topic] == nil {
			m[o.Topic] = make(map[int]int64)
		}
		m[o.Topic][int(o.Partition)] = o.Offset
	}
	// An error means the group moved on (rebalance) or the coordinator is
	// away: the next owner starts from the last successful commit.
	return nil, g.gen.CommitOffsets(m)
}

// republisher returns the writer for retry and dead-letter messages.
func (c *Consumer) republisher() (MessageWriter, func()) {
	if c.cfg.Writer != nil {
		return c.cfg.Writer, func() {}
	}
	tr := &kafka.Transport{}
	if d := c.cfg.Dialer; d != nil {
		tr.Dial = d.DialFunc
		tr.ClientID = d.ClientID
		tr.TLS = d.TLS
		tr.SASL = d.SASLMechanism
		if d.Timeout > 0 {
			tr.DialTimeout = d.Timeout
		}
	}
	w := &kafka.Writer{
		Addr:         kafka.TCP(c.cfg.Brokers...),
		Balancer:     &kafka.Hash{},
		RequiredAcks: kafka.RequireAll,
		BatchTimeout: DefaultRepublishBatch,
		Transport:    tr,
		ErrorLogger:  c.kafkaLogger(slog.LevelDebug),
	}
	return w, func() {
		_ = w.Close()
		tr.CloseIdleConnections()
	}
}

func (c *Consumer) kafkaLogger(level slog.Level) kafka.Logger {
	return kafka.LoggerFunc(func(format string, args ...any) {
		ctx := context.Background()
		if c.log.Enabled(ctx, level) {
			c.log.Log(ctx, level, "kafka-go: "+fmt.Sprintf(format, args...))
		}
	})
}
