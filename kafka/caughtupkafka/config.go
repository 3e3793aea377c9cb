package caughtupkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/retry"
	engine "github.com/caughtup/caughtup/kafka"
)

// Mode says what the Consumer does with a message that cannot run yet
// because no replica has replayed its token (consume.Router.Route returned
// a *consume.DeferError).
type Mode uint8

const (
	// InPlace keeps the message where it is: the partition's worker sleeps
	// for the deferral's delay and routes the message again, until a
	// replica has caught up or the token is older than the router's
	// MaxAge (then the message reads the primary). Order within a
	// partition, and so per key, is kept; the cost is that the messages
	// behind it in that partition wait too. Other partitions keep flowing.
	InPlace Mode = iota
	// RetryTopic republishes the message to ConsumerConfig.RetryTopic with
	// its token, a due time (header HeaderDue) and HeaderDeferred, commits
	// the original and moves on. The consumer reads the retry topic too:
	// the worker of a retry partition takes its head message and waits
	// until it is due or a replica has replayed its token, whichever comes
	// first (Router.WaitCaughtUp, which wakes on the tracker's
	// observations), then routes it again: a replica, another deferral if
	// it is still behind when due, or the primary after MaxAge. Retry
	// partitions are roughly in due order, and a message behind the head
	// waits for the head even if its own token is caught up. Messages
	// retried after a handler error wait out their backoff. The partition
	// never stalls, but a deferred message runs after later messages of
	// its key: use it only for work whose order does not matter.
	RetryTopic
)

func (m Mode) String() string {
	switch m {
	case InPlace:
		return "in_place"
	case RetryTopic:
		return "retry_topic"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// Headers the Consumer writes on messages it republishes to the retry or
// dead-letter topic, besides the token (position.HeaderName), which is
// copied unchanged. Numbers are decimal text. The names and meanings are
// caughtupkgo's too, so that a retry topic written by one Kafka adapter is
// read correctly by the other.
const (
	// HeaderDue is when a republished message may run, in Unix
	// milliseconds.
	HeaderDue = engine.HeaderDue
	// HeaderDeferred ("1") marks a message republished to the retry topic
	// because no replica had replayed its token, rather than after a
	// handler error: it runs at its due time or as soon as a replica has
	// caught up, whichever comes first.
	HeaderDeferred = engine.HeaderDeferred
	// HeaderAttempts counts the handler's failed attempts so far.
	HeaderAttempts = engine.HeaderAttempts
	// HeaderOriginTopic, HeaderOriginPartition and HeaderOriginOffset name
	// where the message was first consumed from.
	HeaderOriginTopic     = engine.HeaderOriginTopic
	HeaderOriginPartition = engine.HeaderOriginPartition
	HeaderOriginOffset    = engine.HeaderOriginOffset
	// HeaderError is the last handler error, on dead-lettered messages.
	HeaderError = engine.HeaderError
)

// Defaults, exported so that documentation and callers can refer to them.
const (
	DefaultMaxAttempts         = 5
	DefaultRetryBackoffInitial = 100 * time.Millisecond
	DefaultRetryBackoffMax     = 10 * time.Second
	DefaultCommitInterval      = time.Second
	DefaultMaxWait             = 500 * time.Millisecond
	DefaultQueueCapacity       = 100
	DefaultRepublishBatch      = 2 * time.Millisecond
)

// ErrInvalidConfig is wrapped by every error ConsumerConfig.Validate
// returns.
var ErrInvalidConfig = errors.New("caughtup/kafka: invalid consumer config")

// ConsumerConfig configures a Consumer. The zero value of every optional
// field means its documented default.
type ConsumerConfig struct {
	// Brokers are the bootstrap addresses. Required.
	Brokers []string
	// GroupID is the consumer group. Required.
	GroupID string
	// Topic is the topic consumed. Required.
	Topic string

	// Router routes each message before the handler runs: the handler's
	// context carries the chosen pools (consume.DB, consume.SQLDB).
	// Required: without it a handler that asks for its pool has none, so
	// NewConsumer refuses a nil Router. Build one per process with
	// consume.NewRouter; to read every message from the primary, keep the
	// Router and set Policy to consume.Always.
	Router *consume.Router
	// Policy is the routing policy of every message.
	// Default: consume.PolicyDefault, the router's Config.DefaultPolicy.
	// One setting in the router then serves every adapter.
	Policy consume.Policy

	// TokenFormat says where each message's token comes from.
	// TokenDebezium reads Debezium change events instead, and routes each
	// by its source position under the commit-safe rule (Debezium below).
	// Default: TokenHeader, the header the stamping Writer (or an outbox
	// relay) put on it.
	TokenFormat TokenFormat
	// Debezium configures TokenFormat TokenDebezium; unused otherwise.
	Debezium DebeziumConfig

	// Mode is what happens to a message no replica can serve yet.
	// Default: InPlace.
	// It keeps the order within a partition, and so per key.
	Mode Mode
	// RetryTopic is where RetryTopic mode republishes deferred and failed
	// messages; the consumer group reads it as well as Topic. It must
	// exist (or the cluster must create topics on first use), and must
	// differ from Topic. Unused in InPlace mode.
	// Default: Topic + ".retry".
	RetryTopic string
	// DeadLetterTopic receives messages whose handler failed MaxAttempts
	// times, with HeaderError and HeaderAttempts, unless DeadLetter is set.
	// It must exist (or be auto-created): until a dead letter is written,
	// its partition does not move on. It must differ from Topic (and, in
	// RetryTopic mode, from RetryTopic).
	// Default: Topic + ".dlt".
	DeadLetterTopic string
	// DeadLetter, when set, is called instead of writing to
	// DeadLetterTopic. An error makes the consumer call it again after a
	// backoff; the message is committed only once it returns nil.
	// Default: nil, write to DeadLetterTopic.
	DeadLetter func(ctx context.Context, msg kafka.Message, err error) error

	// MaxAttempts is how many times the handler runs a message that keeps
	// failing before it is dead-lettered. Deferrals never count. Must not
	// be negative.
	// Default: DefaultMaxAttempts (5).
	MaxAttempts int
	// RetryBackoffInitial and RetryBackoffMax shape the delay between
	// failed attempts: the initial delay, doubling up to the maximum.
	// InPlace sleeps it in place; RetryTopic uses it as the due time.
	// Neither may be negative, and RetryBackoffMax must be at least
	// RetryBackoffInitial.
	// Default: DefaultRetryBackoffInitial (100ms), DefaultRetryBackoffMax
	// (10s).
	RetryBackoffInitial time.Duration
	RetryBackoffMax     time.Duration

	// CommitInterval is how often processed offsets are committed. Offsets
	// are also committed when a generation ends and when the consumer
	// stops. A crash redelivers at most what was processed in the last
	// interval. Must not be negative.
	// Default: DefaultCommitInterval (1s).
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

	// Logger logs redeliveries, dead letters and broker errors.
	// Default: slog.Default().
	Logger *slog.Logger
	// MeterProvider records caughtup.kafka.messages.
	// Default: otel.GetMeterProvider(), the application's global one.
	MeterProvider metric.MeterProvider
	// TracerProvider makes the caughtup.defer span of each deferral: a
	// wait in place (its end is the wake) or a republication to the retry
	// topic. The routing spans are the router's
	// (consume.Config.TracerProvider).
	// Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// Propagators read the producer's trace context from the message's
	// headers (HeaderCarrier), where Writer and Stamp wrote it, so that
	// the message's spans continue the producer's trace. A context that
	// already has a span keeps it as their parent.
	// Default: otel.GetTextMapPropagator(), which propagates nothing until
	// the application sets one (otel.SetTextMapPropagator).
	Propagators propagation.TextMapPropagator
}

// WithDefaults returns c with every zero optional field set to its
// default. Logger, MeterProvider, TracerProvider and Propagators stay nil;
// NewConsumer fills them with the globals.
func (c ConsumerConfig) WithDefaults() ConsumerConfig {
	if c.RetryTopic == "" && c.Topic != "" {
		c.RetryTopic = c.Topic + ".retry"
	}
	if c.DeadLetterTopic == "" && c.Topic != "" {
		c.DeadLetterTopic = c.Topic + ".dlt"
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.RetryBackoffInitial == 0 {
		c.RetryBackoffInitial = DefaultRetryBackoffInitial
	}
	if c.RetryBackoffMax == 0 {
		c.RetryBackoffMax = DefaultRetryBackoffMax
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = DefaultCommitInterval
	}
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
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case len(c.Brokers) == 0:
		return bad("Brokers is empty; give at least one bootstrap address")
	case c.GroupID == "":
		return bad("GroupID is empty; name the consumer group")
	case c.Topic == "":
		return bad("Topic is empty; name the topic to consume")
	case c.Router == nil:
		return bad("Router is nil; build one with consume.NewRouter and set it, so that handlers get their pool (Policy consume.Always reads every message from the primary)")
	case !validPolicy(c.Policy):
		return bad("unknown Policy %d; use a consume.Policy constant", c.Policy)
	case c.Mode != InPlace && c.Mode != RetryTopic:
		return bad("unknown Mode %d; use InPlace or RetryTopic", c.Mode)
	case c.Mode == RetryTopic && c.RetryTopic == c.Topic:
		return bad("RetryTopic must differ from Topic")
	case c.DeadLetter == nil && (c.DeadLetterTopic == c.Topic || c.DeadLetterTopic == c.RetryTopic && c.Mode == RetryTopic):
		return bad("DeadLetterTopic must differ from Topic and RetryTopic")
	case c.MaxAttempts < 1:
		return bad("MaxAttempts %d must be at least 1", c.MaxAttempts)
	case c.RetryBackoffInitial <= 0 || c.RetryBackoffMax < c.RetryBackoffInitial:
		return bad("retry backoff must be positive with RetryBackoffMax >= RetryBackoffInitial")
	case c.CommitInterval <= 0:
		return bad("CommitInterval must be positive")
	case c.StartOffset != kafka.FirstOffset && c.StartOffset != kafka.LastOffset:
		return bad("StartOffset must be kafka.FirstOffset or kafka.LastOffset")
	case c.MaxWait <= 0 || c.QueueCapacity < 1 || c.MinBytes < 0 || c.MaxBytes < 0:
		return bad("MaxWait and QueueCapacity must be positive, MinBytes and MaxBytes not negative")
	case c.TokenFormat != TokenHeader && c.TokenFormat != TokenDebezium:
		return bad("unknown TokenFormat %d; use TokenHeader or TokenDebezium", c.TokenFormat)
	case c.TokenFormat == TokenDebezium && c.Debezium.Database == "":
		return bad("Debezium.Database is empty and the Router has several databases; name the one the connector captures (a key of consume.Config.Databases)")
	case c.TokenFormat == TokenDebezium:
		if _, ok := c.Router.Config().Databases[c.Debezium.Database]; !ok {
			return bad("Debezium.Database %q is not one of the Router's databases (consume.Config.Databases); name the one the connector captures", c.Debezium.Database)
		}
	}
	return nil
}

// validPolicy reports whether p is one of consume's policies.
func validPolicy(p consume.Policy) bool {
	_, err := consume.ParsePolicy(p.String())
	return err == nil
}

// topics is what the consumer group subscribes to.
func (c *ConsumerConfig) topics() []string {
	if c.Mode == RetryTopic {
		return []string{c.Topic, c.RetryTopic}
	}
	return []string{c.Topic}
}

// retryDelay is the delay after the n-th failed attempt (n >= 1).
func (c *ConsumerConfig) retryDelay(n int) time.Duration {
	return retry.Nth(n, c.RetryBackoffInitial, c.RetryBackoffMax)
}
