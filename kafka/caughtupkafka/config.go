package caughtupkafka

import (
	"context"
	"log/slog"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	engine "github.com/caughtup/caughtup/kafka"
)

// Mode says what the Consumer does with a message that cannot run yet
// because no replica has replayed its token: engine.Mode, the same in
// both Kafka adapters. A kafka-go partition holds a message in place by
// not reading its Reader; the messages behind it wait in that Reader's
// buffer.
type Mode = engine.Mode

// The modes (engine.InPlace, engine.RetryTopic).
const (
	InPlace    = engine.InPlace
	RetryTopic = engine.RetryTopic
)

// Headers the Consumer writes on messages it republishes to the retry or
// dead-letter topic (package kafka's, the same in caughtupkgo).
const (
	HeaderDue             = engine.HeaderDue
	HeaderDeferred        = engine.HeaderDeferred
	HeaderAttempts        = engine.HeaderAttempts
	HeaderOriginTopic     = engine.HeaderOriginTopic
	HeaderOriginPartition = engine.HeaderOriginPartition
	HeaderOriginOffset    = engine.HeaderOriginOffset
	HeaderError           = engine.HeaderError
)

// Defaults, exported so that documentation and callers can refer to them;
// the first four are package kafka's.
const (
	DefaultMaxAttempts         = engine.DefaultMaxAttempts
	DefaultRetryBackoffInitial = engine.DefaultRetryBackoffInitial
	DefaultRetryBackoffMax     = engine.DefaultRetryBackoffMax
	DefaultCommitInterval      = engine.DefaultCommitInterval
	DefaultMaxWait             = 500 * time.Millisecond
	DefaultQueueCapacity       = 100
	DefaultRepublishBatch      = 2 * time.Millisecond
)

// ErrInvalidConfig is wrapped by every error ConsumerConfig.Validate
// returns (engine.ErrInvalidConfig, caughtupkgo's too).
var ErrInvalidConfig = engine.ErrInvalidConfig

// ConsumerConfig configures a Consumer. The zero value of every optional
// field means its documented default.
//
// GroupID, Topic, Router, Policy, Mode, RetryTopic, DeadLetterTopic,
// DeadLetter, MaxAttempts, RetryBackoffInitial, RetryBackoffMax,
// CommitInterval, Logger, MeterProvider, TracerProvider and Propagators
// are engine.Config's, with its defaults and rules: both Kafka adapters
// read them alike. The rest is kafka-go's.
type ConsumerConfig struct {
	// Brokers are the bootstrap addresses. Required.
	Brokers []string
	// GroupID is the consumer group; Topic is the topic consumed. Both
	// required.
	GroupID string
	Topic   string

	// Router routes each message before the handler runs: the handler's
	// context carries the chosen pools. Required. Policy is the routing
	// policy of every message (default: the router's DefaultPolicy).
	Router *consume.Router
	Policy consume.Policy

	// TokenFormat says where each message's token comes from.
	// TokenDebezium reads Debezium change events instead, and routes each
	// by its source position under the commit-safe rule (Debezium below).
	// Default: TokenHeader, the header the stamping Writer (or an outbox
	// relay) put on it.
	TokenFormat TokenFormat
	// Debezium configures TokenFormat TokenDebezium; unused otherwise.
	Debezium DebeziumConfig

	// Mode is what happens to a message no replica can serve yet
	// (default InPlace); RetryTopic (default Topic + ".retry") is where
	// RetryTopic mode republishes, and the group reads it too.
	Mode       Mode
	RetryTopic string
	// DeadLetterTopic (default Topic + ".dlt") receives messages whose
	// handler failed MaxAttempts times, unless the DeadLetter hook is set,
	// which then gets each of them until it returns nil.
	DeadLetterTopic string
	DeadLetter      func(ctx context.Context, msg kafka.Message, err error) error
	// MaxAttempts (default 5) bounds the handler's runs of a failing
	// message; RetryBackoffInitial and RetryBackoffMax (default 100ms,
	// doubling to 10s) space them. Deferrals never count.
	MaxAttempts         int
	RetryBackoffInitial time.Duration
	RetryBackoffMax     time.Duration
	// CommitInterval (default 1s) is how often done offsets are committed;
	// also when a generation ends and when the consumer stops.
	CommitInterval time.Duration

	// GroupBalancers, HeartbeatInterval, SessionTimeout, RebalanceTimeout
	// and JoinGroupBackoff are passed to kafka.ConsumerGroupConfig.
	// HeartbeatInterval also bounds how long a rebalance takes to be
	// noticed.
	// Default: kafka-go's (Range then RoundRobin balancers; heartbeat 3s,
	// session timeout 30s, rebalance timeout 30s, join backoff 5s).
	GroupBalancers    []kafka.GroupBalancer
	HeartbeatInterval time.Duration
	SessionTimeout    time.Duration
	RebalanceTimeout  time.Duration
	JoinGroupBackoff  time.Duration
	// WatchPartitionChanges makes the group rebalance when partitions are
	// added to its topics (checked every 5s).
	// Default: false, as in kafka-go.
	WatchPartitionChanges bool
	// StartOffset is where a partition without a committed offset starts:
	// kafka.FirstOffset or kafka.LastOffset.
	// Default: kafka.FirstOffset.
	StartOffset int64

	// MaxWait bounds how long a per-partition reader's fetch waits for new
	// data, and so how long closing a reader at the end of a generation
	// takes. Must not be negative.
	// Default: DefaultMaxWait (500ms).
	// kafka-go's own 10s could hold up the end of every generation that
	// long.
	MaxWait time.Duration
	// QueueCapacity is how many fetched messages each partition buffers
	// ahead of its worker. Must not be negative.
	// Default: DefaultQueueCapacity (100).
	QueueCapacity int
	// MinBytes and MaxBytes bound each fetch of the per-partition readers.
	// Must not be negative.
	// Default: kafka-go's (1 and 1MB).
	MinBytes int
	MaxBytes int

	// Dialer opens the group's and the readers' connections (and those of
	// the default Writer).
	// Default: kafka.DefaultDialer.
	Dialer *kafka.Dialer
	// Writer republishes to the retry and dead-letter topics; messages
	// name their topic, so it must not set one. WriteMessages must return
	// only once the broker has acknowledged the messages: the original is
	// committed right after.
	// Default: a kafka.Writer on Brokers, dialing with Dialer, with a Hash
	// balancer, RequiredAcks all and a DefaultRepublishBatch (2ms) batch
	// timeout, closed when Run returns.
	// Hash keeps a key on one partition; the batch timeout is short
	// because each republish waits for its batch.
	Writer MessageWriter

	// Logger (default slog.Default()), MeterProvider, TracerProvider and
	// Propagators (default the globals) log, count
	// (caughtup.kafka.messages), trace the deferrals of, and continue the
	// producers' traces of the messages; Writer and Stamp wrote those
	// into the headers (HeaderCarrier).
	Logger         *slog.Logger
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
	Propagators    propagation.TextMapPropagator
}

// shared is c's engine.Config.
func (c *ConsumerConfig) shared() engine.Config[*kafka.Message] {
	ec := engine.Config[*kafka.Message]{GroupID: c.GroupID, Topic: c.Topic, Router: c.Router, Policy: c.Policy,
		Mode: c.Mode, RetryTopic: c.RetryTopic, DeadLetterTopic: c.DeadLetterTopic, MaxAttempts: c.MaxAttempts,
		RetryBackoffInitial: c.RetryBackoffInitial, RetryBackoffMax: c.RetryBackoffMax, CommitInterval: c.CommitInterval,
		Logger: c.Logger, MeterProvider: c.MeterProvider, TracerProvider: c.TracerProvider, Propagators: c.Propagators}
	if h := c.DeadLetter; h != nil {
		ec.DeadLetter = func(ctx context.Context, msg *kafka.Message, err error) error { return h(ctx, *msg, err) }
	}
	return ec
}

// WithDefaults returns c with every zero optional field set to its
// default (engine.Config.WithDefaults for the shared fields, the global
// OpenTelemetry providers and slog's default logger among them).
// NewConsumer calls it; it is the one place defaults are filled.
func (c ConsumerConfig) WithDefaults() ConsumerConfig {
	ec := c.shared().WithDefaults()
	c.RetryTopic, c.DeadLetterTopic, c.MaxAttempts = ec.RetryTopic, ec.DeadLetterTopic, ec.MaxAttempts
	c.RetryBackoffInitial, c.RetryBackoffMax, c.CommitInterval = ec.RetryBackoffInitial, ec.RetryBackoffMax, ec.CommitInterval
	c.Logger, c.MeterProvider, c.TracerProvider, c.Propagators = ec.Logger, ec.MeterProvider, ec.TracerProvider, ec.Propagators
	if c.StartOffset == 0 {
		c.StartOffset = kafka.FirstOffset
	}
	if c.MaxWait == 0 {
		c.MaxWait = DefaultMaxWait
	}
	if c.QueueCapacity == 0 {
		c.QueueCapacity = DefaultQueueCapacity
	}
	if c.TokenFormat == TokenDebezium && c.Debezium.Database == "" && c.Router != nil {
		if dbs := c.Router.Config().Databases; len(dbs) == 1 {
			for name := range dbs {
				c.Debezium.Database = name
			}
		}
	}
	return c
}

// Validate checks a config after WithDefaults.
func (c ConsumerConfig) Validate() error {
	if len(c.Brokers) == 0 {
		return engine.Invalid("Brokers is empty; give at least one bootstrap address")
	}
	if err := c.shared().Validate(); err != nil {
		return err
	}
	switch {
	case c.StartOffset != kafka.FirstOffset && c.StartOffset != kafka.LastOffset:
		return engine.Invalid("StartOffset must be kafka.FirstOffset or kafka.LastOffset")
	case c.MaxWait <= 0 || c.QueueCapacity < 1 || c.MinBytes < 0 || c.MaxBytes < 0:
		return engine.Invalid("MaxWait and QueueCapacity must be positive, MinBytes and MaxBytes not negative")
	case c.TokenFormat != TokenHeader && c.TokenFormat != TokenDebezium:
		return engine.Invalid("unknown TokenFormat %d; use TokenHeader or TokenDebezium", c.TokenFormat)
	case c.TokenFormat == TokenDebezium && c.Debezium.Database == "":
		return engine.Invalid("Debezium.Database is empty and the Router has several databases; name the one the connector captures (a key of consume.Config.Databases)")
	case c.TokenFormat == TokenDebezium:
		if _, ok := c.Router.Config().Databases[c.Debezium.Database]; !ok {
			return engine.Invalid("Debezium.Database %q is not one of the Router's databases (consume.Config.Databases); name the one the connector captures", c.Debezium.Database)
		}
	}
	return nil
}

// Attempt returns how many times the handler already failed on the
// message being handled in ctx: 0 on the first attempt
// (engine.Attempt). Deferrals never count. In RetryTopic mode the count
// travels with the message in HeaderAttempts.
func Attempt(ctx context.Context) int { return engine.Attempt(ctx) }
