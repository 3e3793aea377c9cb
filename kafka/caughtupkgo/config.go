package caughtupkgo

import (
	"context"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka"
)

// Mode says what the Consumer does with a record that cannot run yet
// because no replica has replayed its token: kafka.Mode, the same in both
// Kafka adapters. A franz-go partition holds a record in place by pausing
// its fetches (kgo.Client.PauseFetchPartitions): records of that
// partition already polled stay queued behind it, in order, and nothing
// more is fetched for it until it has drained; the poll loop never waits
// for a partition.
type Mode = kafka.Mode

// The modes (kafka.InPlace, kafka.RetryTopic).
const (
	InPlace    = kafka.InPlace
	RetryTopic = kafka.RetryTopic
)

// Defaults of the franz-go settings, exported so that documentation and
// callers can refer to them; the engine's are package kafka's
// (kafka.DefaultMaxAttempts and the rest). The retry and dead-letter
// headers are package kafka's too (kafka.HeaderDue and the rest).
const (
	DefaultQueueCapacity = 1000
	// Deprecated: MaxPollRecords is not used.
	DefaultMaxPollRecords = 500
)

// ErrInvalidConfig is wrapped by every error ConsumerConfig.Validate
// returns (kafka.ErrInvalidConfig, caughtupkafka's too).
var ErrInvalidConfig = kafka.ErrInvalidConfig

// ConsumerConfig configures a Consumer. The zero value of every optional
// field means its documented default.
//
// Besides ClientOpts, QueueCapacity, MaxPollRecords, OnRevoked and
// OnLost, which are franz-go's, the fields are kafka.Config's, with its
// defaults and rules: both Kafka adapters read them alike.
type ConsumerConfig struct {
	// ClientOpts are the franz-go options of the consumer's client: seed
	// brokers (kgo.SeedBrokers), TLS, SASL, fetch sizes, kgo.WithHooks,
	// the reset offset and so on. Required: at least kgo.SeedBrokers.
	//
	// The Consumer adds kgo.ConsumerGroup(GroupID), kgo.ConsumeTopics,
	// kgo.DisableAutoCommit, kgo.BlockRebalanceOnPoll and its own
	// OnPartitionsAssigned, OnPartitionsRevoked and OnPartitionsLost
	// after them, which replace any of those given here: committing only
	// what is done, and dropping a revoked partition's queue before
	// anyone else owns it, is what makes delivery at-least-once.
	// Use OnRevoked and OnLost to be told as well.
	ClientOpts []kgo.Opt
	// GroupID is the consumer group and Topic the topic consumed; both
	// required. Router routes each record before the handler runs
	// (required: it gives the handler its pool), by Policy (default the
	// router's DefaultPolicy).
	GroupID string
	Topic   string
	Router  *consume.Router
	Policy  consume.Policy

	// Mode (default InPlace, the partition paused while its head waits)
	// is what happens to a record no replica can serve yet; RetryTopic
	// (default Topic + ".retry") is where RetryTopic mode produces, and
	// the group reads it too. DeadLetterTopic (default Topic + ".dlt")
	// gets the records whose handler failed MaxAttempts times, unless the
	// DeadLetter hook is set.
	Mode            Mode
	RetryTopic      string
	DeadLetterTopic string
	DeadLetter      func(ctx context.Context, r *kgo.Record, err error) error
	// MaxAttempts (default 5) bounds the handler's runs of a failing
	// record, RetryBackoffInitial and RetryBackoffMax (default 100ms,
	// doubling to 10s) space them, the partition paused in InPlace mode.
	// Deferrals never count.
	MaxAttempts         int
	RetryBackoffInitial time.Duration
	RetryBackoffMax     time.Duration
	// CommitInterval (default 1s) is how often done offsets are
	// committed; also on every revocation and when Run ends.
	CommitInterval time.Duration

	// QueueCapacity bounds the polled records each partition holds ahead
	// of its worker: the poll loop takes everything franz-go has
	// buffered, and pauses the fetches of a partition whose queue reaches
	// QueueCapacity until its worker takes the queue; it polls again once
	// some partition that is not paused holds less than half of it, and
	// meanwhile records wait in franz-go's buffer. A queue may so hold,
	// beyond QueueCapacity, what one fetch returned for its partition
	// (records franz-go held in memory already; its fetch sizes,
	// kgo.FetchMaxPartitionBytes, bound them). Must be positive.
	// Default: DefaultQueueCapacity (1000).
	// Polling everything lets franz-go fetch the next records while the
	// workers run these; pausing only once nothing of the partition is
	// left buffered keeps franz-go from dropping records to fetch and
	// decode them again.
	QueueCapacity int
	// MaxPollRecords is not used: each poll takes everything franz-go has
	// buffered (QueueCapacity).
	//
	// Deprecated: a poll of a few hundred records left the workers
	// waiting for franz-go's next fetch, which it starts only once its
	// buffer has been polled empty.
	MaxPollRecords int

	// OnRevoked and OnLost, when set, are called after the Consumer has
	// handled a revocation (workers stopped, done offsets committed) or a
	// loss (workers stopped, nothing committed), in franz-go's callback
	// goroutine. They must not call Close or LeaveGroup.
	// Default: nil.
	OnRevoked func(ctx context.Context, cl *kgo.Client, revoked map[string][]int32)
	OnLost    func(ctx context.Context, cl *kgo.Client, lost map[string][]int32)

	// Logger (default slog.Default()) logs redeliveries, dead letters and
	// client errors. MeterProvider, TracerProvider and Propagators
	// (default the globals) count (caughtup.kafka.messages), trace the
	// deferrals of, and continue the producers' traces of the records:
	// the span franz-go's kotel plugin put in a record's Context, else
	// the trace context Producer and Stamp wrote into its headers
	// (HeaderCarrier).
	Logger         *slog.Logger
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
	Propagators    propagation.TextMapPropagator
}

// shared is c's kafka.Config.
func (c *ConsumerConfig) shared() kafka.Config[*kgo.Record] {
	return kafka.Config[*kgo.Record]{GroupID: c.GroupID, Topic: c.Topic, Router: c.Router, Policy: c.Policy,
		Mode: c.Mode, RetryTopic: c.RetryTopic, DeadLetterTopic: c.DeadLetterTopic, DeadLetter: c.DeadLetter,
		MaxAttempts: c.MaxAttempts, RetryBackoffInitial: c.RetryBackoffInitial, RetryBackoffMax: c.RetryBackoffMax,
		CommitInterval: c.CommitInterval, Logger: c.Logger, MeterProvider: c.MeterProvider,
		TracerProvider: c.TracerProvider, Propagators: c.Propagators}
}

// WithDefaults returns c with every zero optional field set to its
// default (kafka.Config.WithDefaults for the shared fields, the global
// OpenTelemetry providers and slog's default logger among them).
// NewConsumer calls it; it is the one place defaults are filled.
func (c ConsumerConfig) WithDefaults() ConsumerConfig {
	kc := c.shared().WithDefaults()
	c.RetryTopic, c.DeadLetterTopic, c.MaxAttempts = kc.RetryTopic, kc.DeadLetterTopic, kc.MaxAttempts
	c.RetryBackoffInitial, c.RetryBackoffMax, c.CommitInterval = kc.RetryBackoffInitial, kc.RetryBackoffMax, kc.CommitInterval
	c.Logger, c.MeterProvider, c.TracerProvider, c.Propagators = kc.Logger, kc.MeterProvider, kc.TracerProvider, kc.Propagators
	if c.QueueCapacity == 0 {
		c.QueueCapacity = DefaultQueueCapacity
	}
	if c.MaxPollRecords == 0 {
		c.MaxPollRecords = DefaultMaxPollRecords
	}
	return c
}

// Validate checks a config after WithDefaults.
func (c ConsumerConfig) Validate() error {
	if len(c.ClientOpts) == 0 {
		return kafka.Invalid("ClientOpts is empty; give at least kgo.SeedBrokers")
	}
	if err := c.shared().Validate(); err != nil {
		return err
	}
	if c.QueueCapacity < 1 {
		return kafka.Invalid("QueueCapacity must be positive")
	}
	return nil
}

// Attempt returns how many times the handler already failed on the record
// being handled in ctx: 0 on the first attempt (kafka.Attempt). Deferrals
// (waiting for a replica) never count. In RetryTopic mode the count
// travels with the record in HeaderAttempts.
func Attempt(ctx context.Context) int { return kafka.Attempt(ctx) }
