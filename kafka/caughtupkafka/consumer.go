package caughtupkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/cdc"
	"github.com/caughtup/caughtup/internal/retry"
	engine "github.com/caughtup/caughtup/kafka"
)

// ErrRunning is returned by Run while another Run of the same Consumer is
// still going.
var ErrRunning = errors.New("caughtup/kafka: Consumer.Run is already running; use one Consumer per Run, or wait for the first to return")

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
	cfg     ConsumerConfig
	handler Handler
	log     *slog.Logger
	met     map[string]*engine.Topic
	tracer  trace.Tracer
	prop    propagation.TextMapPropagator

	// For TokenDebezium: the checker, and the router's clock and
	// staleness bound, which say whether its primary's epoch is current.
	checker   *cdc.Checker
	now       func() time.Time
	staleness time.Duration

	running atomic.Bool
}

// NewConsumer validates cfg and returns a Consumer that routes each
// message with cfg.Router and runs h with the routed context. It does not
// connect; Run does. A nil handler or Router is an ErrInvalidConfig.
func NewConsumer(cfg ConsumerConfig, h Handler) (*Consumer, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: the handler is nil", ErrInvalidConfig)
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Brokers = append([]string(nil), cfg.Brokers...)
	c := &Consumer{cfg: cfg, handler: h, log: cfg.Logger}
	if c.log == nil {
		c.log = slog.Default()
	}
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	c.tracer = tp.Tracer(ScopeName)
	if c.prop = cfg.Propagators; c.prop == nil {
		c.prop = otel.GetTextMapPropagator()
	}
	var err error
	if c.met, err = engine.NewTopics(mp, ScopeName, cfg.topics()); err != nil {
		return nil, fmt.Errorf("caughtup/kafka: creating instruments: %w", err)
	}
	if cfg.TokenFormat == TokenDebezium {
		if c.checker = cfg.Debezium.Checker; c.checker == nil {
			if c.checker, err = cdc.NewChecker(cdc.Config{MeterProvider: mp}); err != nil {
				return nil, fmt.Errorf("caughtup/kafka: creating the CDC checker: %w", err)
			}
		}
		rc := cfg.Router.Config()
		c.now, c.staleness = rc.Now, rc.Tracker.StalenessBound
	}
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
	if !c.running.CompareAndSwap(false, true) {
		return ErrRunning
	}
	defer c.running.Store(false)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	w, closeWriter := c.republisher()
	defer closeWriter()

	cg, err := kafka.NewConsumerGroup(kafka.ConsumerGroupConfig{
		ID:                    c.cfg.GroupID,
		Brokers:               c.cfg.Brokers,
		Dialer:                c.cfg.Dialer,
		Topics:                c.cfg.topics(),
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
		c.startGeneration(ctx, gen, w)
	}
}

// partition is one assigned partition within one generation.
type partition struct {
	topic string
	id    int
	start int64
	// done is the offset after the last message done, in order; -1 until
	// one is. Written by the partition's worker, read by the committer.
	done atomic.Int64
	// committed is the last offset committed; only the committer uses it.
	committed int64
	// state is the worker's, flushed by the committer.
	state *partState
}

type generation struct {
	gen     *kafka.Generation
	parts   []*partition
	workers sync.WaitGroup
}

func (c *Consumer) startGeneration(ctx context.Context, gen *kafka.Generation, w MessageWriter) {
	g := &generation{gen: gen}
	for _, topic := range c.cfg.topics() {
		for _, a := range gen.Assignments[topic] {
			p := &partition{topic: topic, id: a.ID, start: a.Offset, committed: -1, state: c.newPartState(topic)}
			p.done.Store(-1)
			g.parts = append(g.parts, p)
		}
	}
	if c.log.Enabled(ctx, slog.LevelDebug) {
		assigned := make([]string, len(g.parts))
		for i, p := range g.parts {
			assigned[i] = fmt.Sprintf("%s/%d@%d", p.topic, p.id, p.start)
		}
		c.log.DebugContext(ctx, "caughtup/kafka: generation started",
			slog.String("group", c.cfg.GroupID), slog.Int("generation", int(gen.ID)),
			slog.Any("partitions", assigned))
	}
	g.workers.Add(len(g.parts))
	for _, p := range g.parts {
		gen.Start(func(gctx context.Context) {
			defer g.workers.Done()
			c.runPartition(ctx, gctx, p, w)
		})
	}
	gen.Start(func(gctx context.Context) { c.commitLoop(ctx, gctx, g) })
}

// runPartition fetches one partition with its own Reader and processes its
// messages one at a time, in offset order, until the generation or the
// consumer ends. The Reader, and with it every message it buffered, dies
// with the generation: nothing fetched under a revoked assignment is
// processed later (kafka-go issue #1398 concerns the group Reader's
// shared buffer, which this design does not have).
func (c *Consumer) runPartition(runCtx, gctx context.Context, p *partition, w MessageWriter) {
	ctx, cancel := context.WithCancel(runCtx)
	defer cancel()
	stop := context.AfterFunc(gctx, cancel)
	defer stop()

	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers:         c.cfg.Brokers,
		Topic:           p.topic,
		Partition:       p.id,
		Dialer:          c.cfg.Dialer,
		QueueCapacity:   c.cfg.QueueCapacity,
		MinBytes:        c.cfg.MinBytes,
		MaxBytes:        c.cfg.MaxBytes,
		MaxWait:         c.cfg.MaxWait,
		ReadLagInterval: -1,
		ErrorLogger:     c.kafkaLogger(slog.LevelDebug),
	})
	defer r.Close()
	if err := r.SetOffset(p.start); err != nil {
		c.log.ErrorContext(ctx, "caughtup/kafka: seeking a partition failed", slog.String("topic", p.topic),
			slog.Int("partition", p.id), slog.Any("error", err))
		<-ctx.Done()
		return
	}
	// One partition reads one topic; a retry topic's partitions count
	// under the retry topic.
	ps := p.state
	for fails := 0; ; {
		msg, err := r.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			fails++
			c.log.WarnContext(ctx, "caughtup/kafka: fetching failed; retrying", slog.String("topic", p.topic),
				slog.Int("partition", p.id), slog.Any("error", err))
			if !retry.Sleep(ctx, retry.Nth(fails, 100*time.Millisecond, 5*time.Second)) {
				return
			}
			continue
		}
		fails = 0
		if !c.process(ctx, &msg, w, ps) {
			ps.Add(engine.Dropped)
			c.log.DebugContext(ctx, "caughtup/kafka: message dropped before it was done; it will be delivered again",
				slog.String("topic", msg.Topic), slog.Int("partition", msg.Partition), slog.Int64("offset", msg.Offset))
			return
		}
		p.done.Store(msg.Offset + 1)
	}
}

// commitLoop commits done offsets every CommitInterval and, once the
// generation or the consumer ends, after every worker has stopped. Commits
// carry the generation: the coordinator rejects them once the group has
// moved on, so a partition this member lost is never committed by it.
func (c *Consumer) commitLoop(runCtx, gctx context.Context, g *generation) {
	t := time.NewTicker(c.cfg.CommitInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			c.commit(runCtx, g)
			g.flush(runCtx)
			continue
		case <-gctx.Done():
		case <-runCtx.Done():
		}
		g.workers.Wait()
		c.commit(context.WithoutCancel(runCtx), g)
		g.flush(runCtx)
		return
	}
}

// flush adds what the partitions counted since the last flush to the
// instruments (partState).
func (g *generation) flush(ctx context.Context) {
	for _, p := range g.parts {
		p.state.Flush(ctx)
	}
}

func (c *Consumer) commit(ctx context.Context, g *generation) {
	var offsets map[string]map[int]int64
	for _, p := range g.parts {
		d := p.done.Load()
		if d <= p.committed {
			continue
		}
		if offsets == nil {
			offsets = make(map[string]map[int]int64)
		}
		if offsets[p.topic] == nil {
			offsets[p.topic] = make(map[int]int64)
		}
		offsets[p.topic][p.id] = d
	}
	if offsets == nil {
		return
	}
	if err := g.gen.CommitOffsets(offsets); err != nil {
		// The group moved on (rebalance) or the coordinator is away: the
		// next owner starts from the last successful commit and processes
		// the rest again.
		c.log.InfoContext(ctx, "caughtup/kafka: committing offsets failed; uncommitted messages will be delivered again",
			slog.String("group", c.cfg.GroupID), slog.Int("generation", int(g.gen.ID)), slog.Any("error", err))
		return
	}
	for _, p := range g.parts {
		if o, ok := offsets[p.topic][p.id]; ok {
			p.committed = o
		}
	}
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
