package caughtupkgo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/retry"
	"github.com/caughtup/caughtup/kafka"
)

// Mode says what the Consumer does with a record that cannot run yet
// because no replica has replayed its token (consume.Router.Route returned
// a *consume.DeferError).
type Mode uint8

const (
	// InPlace keeps the record at the head of its partition and pauses
	// the partition's fetches (kgo.Client.PauseFetchPartitions) while it
	// waits: records of that partition already fetched stay queued behind
	// it, in order, and nothing more is fetched for it until it has
	// drained. The record is held for the deferral's delay, or until a
	// replica has replayed its token if that comes first, and routed
	// again, until it runs on a replica or its token is older than the
	// router's MaxAge (then it reads the primary). Order within a
	// partition, and so per key, is kept; other partitions keep flowing,
	// since the poll loop never waits for a partition.
	InPlace Mode = iota
	// RetryTopic produces the record to ConsumerConfig.RetryTopic with its
	// token, a due time (HeaderDue) and HeaderDeferred, waits for the
	// broker's acknowledgement, marks the original done and moves on. The
	// consumer reads the retry topic too: a retry partition's head record
	// waits (its partition paused) until it is due or a replica has
	// replayed its token, whichever comes first, then is routed again.
	// The partition never stalls, but a deferred record runs after later
	// records of its key: use it only for work whose order does not
	// matter.
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

// Headers the Consumer writes on records it produces to the retry or
// dead-letter topic, besides the token (position.HeaderName), which is
// copied unchanged. Numbers are decimal text. The names and meanings are
// caughtupkafka's, so that a retry topic written by one adapter is read
// correctly by the other.
const (
	// HeaderDue is when a republished record may run, in Unix
	// milliseconds.
	HeaderDue = kafka.HeaderDue
	// HeaderDeferred ("1") marks a record republished because no replica
	// had replayed its token, rather than after a handler error: it runs
	// at its due time or as soon as a replica has caught up, whichever
	// comes first.
	HeaderDeferred = kafka.HeaderDeferred
	// HeaderAttempts counts the handler's failed attempts so far.
	HeaderAttempts = kafka.HeaderAttempts
	// HeaderOriginTopic, HeaderOriginPartition and HeaderOriginOffset name
	// where the record was first consumed from.
	HeaderOriginTopic     = kafka.HeaderOriginTopic
	HeaderOriginPartition = kafka.HeaderOriginPartition
	HeaderOriginOffset    = kafka.HeaderOriginOffset
	// HeaderError is the last handler error, on dead-lettered records.
	HeaderError = kafka.HeaderError
)

// Defaults, exported so that documentation and callers can refer to them.
const (
	DefaultMaxAttempts         = 5
	DefaultRetryBackoffInitial = 100 * time.Millisecond
	DefaultRetryBackoffMax     = 10 * time.Second
	DefaultCommitInterval      = time.Second
	DefaultQueueCapacity       = 1000
	DefaultMaxPollRecords      = 500
)

// ErrInvalidConfig is wrapped by every error ConsumerConfig.Validate
// returns.
var ErrInvalidConfig = errors.New("caughtup/kgo: invalid consumer config")

// ConsumerConfig configures a Consumer. The zero value of every optional
// field means its documented default.
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
	// GroupID is the consumer group. Required.
	GroupID string
	// Topic is the topic consumed. Required.
	Topic string

	// Router routes each record before the handler runs: the handler's
	// context carries the chosen pools (consume.DB, consume.SQLDB).
	// Required: without it a handler that asks for its pool has none. To
	// read every record from the primary, keep the Router and set Policy
	// to consume.Always.
	Router *consume.Router
	// Policy is the routing policy of every record.
	// Default: consume.PolicyDefault, the router's Config.DefaultPolicy.
	// One setting in the router then serves every adapter.
	Policy consume.Policy

	// Mode is what happens to a record no replica can serve yet.
	// Default: InPlace.
	// It keeps the order within a partition, and so per key.
	Mode Mode
	// RetryTopic is where RetryTopic mode produces deferred and failed
	// records; the group reads it as well as Topic. It must exist (or the
	// cluster must create topics on first use) and differ from Topic.
	// Unused in InPlace mode.
	// Default: Topic + ".retry".
	RetryTopic string
	// DeadLetterTopic receives records whose handler failed MaxAttempts
	// times, with HeaderError and HeaderAttempts, unless DeadLetter is
	// set. Until a dead letter is acknowledged, its partition does not
	// move on. It must differ from Topic and RetryTopic.
	// Default: Topic + ".dlt".
	DeadLetterTopic string
	// DeadLetter, when set, is called instead of producing to
	// DeadLetterTopic. An error makes the consumer call it again after a
	// backoff; the record is marked done only once it returns nil.
	// Default: nil, produce to DeadLetterTopic.
	DeadLetter func(ctx context.Context, r *kgo.Record, err error) error

	// MaxAttempts is how many times the handler runs a record that keeps
	// failing before it is dead-lettered. Deferrals never count.
	// Default: DefaultMaxAttempts (5).
	MaxAttempts int
	// RetryBackoffInitial and RetryBackoffMax shape the delay between
	// failed attempts: the initial delay, doubling up to the maximum
	// (internal/retry). InPlace holds it with the partition paused;
	// RetryTopic uses it as the due time.
	// Default: DefaultRetryBackoffInitial (100ms), DefaultRetryBackoffMax
	// (10s).
	RetryBackoffInitial time.Duration
	RetryBackoffMax     time.Duration

	// CommitInterval is how often done offsets are committed. Offsets are
	// also committed when partitions are revoked and when Run ends. A
	// crash redelivers at most what was done in the last interval.
	// Default: DefaultCommitInterval (1s).
	CommitInterval time.Duration
	// QueueCapacity is how many polled records each partition may hold
	// ahead of its worker. The poll loop polls again only once some
	// partition that is not paused holds less than half of it, so a
	// consumer that is slower than its fetches waits in franz-go's
	// buffer, not in memory here; a partition whose queue still reaches
	// it while another partition's worker is idle (its worker is slower
	// than the others') has its fetches paused until it has drained. Must
	// be positive.
	// Default: DefaultQueueCapacity (1000).
	// A pause throws away what franz-go buffered for the partition and
	// costs a fetch to undo, so pauses are for partitions that wait, not
	// for ordinary flow; the bound keeps memory small for large records.
	QueueCapacity int
	// MaxPollRecords bounds the records one poll returns
	// (kgo.Client.PollRecords). The poll only hands records to the
	// partitions' queues, so it returns quickly; the bound keeps one poll
	// from filling a queue past QueueCapacity, and the time a rebalance
	// waits for a poll short. Must be positive.
	// Default: DefaultMaxPollRecords (500).
	MaxPollRecords int

	// OnRevoked and OnLost, when set, are called after the Consumer has
	// handled a revocation (workers stopped, done offsets committed) or a
	// loss (workers stopped, nothing committed), in franz-go's callback
	// goroutine. They must not call Close or LeaveGroup.
	// Default: nil.
	OnRevoked func(ctx context.Context, cl *kgo.Client, revoked map[string][]int32)
	OnLost    func(ctx context.Context, cl *kgo.Client, lost map[string][]int32)

	// Logger logs redeliveries, dead letters and client errors.
	// Default: slog.Default().
	Logger *slog.Logger
	// MeterProvider records caughtup.kafka.messages.
	// Default: otel.GetMeterProvider(), the application's global one.
	MeterProvider metric.MeterProvider
	// TracerProvider makes the consume.SpanDefer span of each deferral (a
	// wait in place, ending at the catch-up, or a republication to the
	// retry topic) and consume.SpanWake for a retry-topic record held
	// until its catch-up, inside the record's trace. The routing spans are
	// the router's (consume.Config.TracerProvider).
	// Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// Propagators read the producer's trace context from the record's
	// headers (HeaderCarrier), where Producer and Stamp wrote it, when the
	// record's Context has no span of franz-go's kotel plugin.
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
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case len(c.ClientOpts) == 0:
		return bad("ClientOpts is empty; give at least kgo.SeedBrokers")
	case c.GroupID == "":
		return bad("GroupID is empty; name the consumer group")
	case c.Topic == "":
		return bad("Topic is empty; name the topic to consume")
	case c.Router == nil:
		return bad("Router is nil; build one with consume.NewRouter and set it, so that handlers get their pool (Policy consume.Always reads every record from the primary)")
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
	case c.QueueCapacity < 1 || c.MaxPollRecords < 1:
		return bad("QueueCapacity and MaxPollRecords must be positive")
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
