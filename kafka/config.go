package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/internal/retry"
)

// Mode says what the Engine does with a record that cannot run yet
// because no replica has replayed its token (consume.Router.Route returned
// a *consume.DeferError).
type Mode uint8

const (
	// InPlace keeps the record at the head of its partition: the
	// partition's worker holds it (its Source paused) for the deferral's
	// delay, or until a replica has replayed its token if that comes
	// first, and routes it again, until it runs on a replica or its token
	// is older than the router's MaxAge (then it reads the primary). Order
	// within a partition, and so per key, is kept; the records behind it
	// in that partition wait too. Other partitions keep flowing.
	InPlace Mode = iota
	// RetryTopic republishes the record to Config.RetryTopic with its
	// token, a due time (HeaderDue) and HeaderDeferred, marks the original
	// done and moves on. The group reads the retry topic too: the worker
	// of a retry partition holds its head record until it is due or a
	// replica has replayed its token, whichever comes first
	// (consume.Router.WaitCaughtUp, which wakes on the tracker's
	// observations), then routes it again: a replica, another deferral if
	// it is still behind when due, or the primary after MaxAge. Retry
	// partitions are roughly in due order, and a record behind the head
	// waits for the head even if its own token is caught up. Records
	// retried after a handler error wait out their backoff. The partition
	// never stalls, but a deferred record runs after later records of its
	// key: use it only for work whose order does not matter.
	RetryTopic
)

// String is the mode's name ("in_place", "retry_topic"), as on the
// caughtup.kafka.defer span attribute.
func (m Mode) String() string {
	switch m {
	case InPlace:
		return "in_place"
	case RetryTopic:
		return "retry_topic"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// Defaults, exported so that documentation and callers can refer to them.
const (
	DefaultMaxAttempts         = 5
	DefaultRetryBackoffInitial = 100 * time.Millisecond
	DefaultRetryBackoffMax     = 10 * time.Second
	DefaultCommitInterval      = time.Second
)

// ErrInvalidConfig is wrapped by every error Config.Validate (and each
// adapter's ConsumerConfig.Validate) returns.
var ErrInvalidConfig = errors.New("caughtup/kafka: invalid consumer config")

// Config is what a consumer of either adapter decides about its records:
// how they are routed, deferred, retried and dead-lettered, committed and
// observed. R is the adapter's record type. Each adapter's ConsumerConfig
// has these fields under the same names, beside its client's own, and
// hands them to the Engine. The zero value of every optional field means
// its documented default.
type Config[R any] struct {
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
	// RetryTopic is where RetryTopic mode republishes deferred and failed
	// records; the group reads it as well as Topic. It must exist (or the
	// cluster must create topics on first use) and differ from Topic.
	// Unused in InPlace mode.
	// Default: Topic + ".retry".
	RetryTopic string
	// DeadLetterTopic receives records whose handler failed MaxAttempts
	// times, with HeaderError, HeaderAttempts and their origin, unless
	// DeadLetter is set. It must exist (or be auto-created): until a dead
	// letter is acknowledged its partition does not move on. It must
	// differ from Topic and, in RetryTopic mode, from RetryTopic.
	// Default: Topic + ".dlt".
	DeadLetterTopic string
	// DeadLetter, when set, is called instead of producing to
	// DeadLetterTopic. An error makes the consumer call it again after a
	// backoff; the record is done only once it returns nil.
	// Default: nil, produce to DeadLetterTopic.
	DeadLetter func(ctx context.Context, r R, err error) error

	// MaxAttempts is how many times the handler runs a record that keeps
	// failing before it is dead-lettered. Deferrals never count, nor does
	// a run whose replica failed it (consume.ReplicaFailed): the record is
	// routed again. Must not be negative.
	// Default: DefaultMaxAttempts (5).
	MaxAttempts int
	// RetryBackoffInitial and RetryBackoffMax shape the delay between
	// failed attempts: the initial delay, doubling up to the maximum
	// (internal/retry). InPlace holds the record that long; RetryTopic
	// uses it as the due time. Neither may be negative, and
	// RetryBackoffMax must be at least RetryBackoffInitial.
	// Default: DefaultRetryBackoffInitial (100ms), DefaultRetryBackoffMax
	// (10s).
	RetryBackoffInitial time.Duration
	RetryBackoffMax     time.Duration

	// CommitInterval is how often done offsets are committed; they are
	// also committed when partitions are revoked and when the consumer
	// stops. A crash redelivers at most what was done in the last
	// interval. Must not be negative.
	// Default: DefaultCommitInterval (1s).
	CommitInterval time.Duration

	// Logger logs redeliveries, dead letters and client errors.
	// Default: slog.Default().
	Logger *slog.Logger
	// MeterProvider records caughtup.kafka.messages.
	// Default: otel.GetMeterProvider(), the application's global one.
	MeterProvider metric.MeterProvider
	// TracerProvider makes the consume.SpanDefer span of each deferral (a
	// hold in place, ending at the catch-up, or a republication to the
	// retry topic) and consume.SpanWake for a retry-topic record held
	// until its catch-up, inside the record's trace. The routing spans are
	// the router's (consume.Config.TracerProvider).
	// Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// Propagators read the producer's trace context from the record's
	// headers (HeaderCarrier), where the adapters' stampers wrote it, so
	// that the record's spans continue the producer's trace. A context
	// that already has a span keeps it as their parent.
	// Default: otel.GetTextMapPropagator(), which propagates nothing until
	// the application sets one (otel.SetTextMapPropagator).
	Propagators propagation.TextMapPropagator
}

// WithDefaults returns c with every zero optional field set to its
// default, the global OpenTelemetry providers and propagators and slog's
// default logger included. New calls it; it is the one place defaults are
// filled.
func (c Config[R]) WithDefaults() Config[R] {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.Propagators == nil {
		c.Propagators = otel.GetTextMapPropagator()
	}
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
	return c
}

// Validate checks a config after WithDefaults.
func (c Config[R]) Validate() error {
	switch {
	case c.GroupID == "":
		return Invalid("GroupID is empty; name the consumer group")
	case c.Topic == "":
		return Invalid("Topic is empty; name the topic to consume")
	case c.Router == nil:
		return Invalid("Router is nil; build one with consume.NewRouter and set it, so that handlers get their pool (Policy consume.Always reads every record from the primary)")
	case !validPolicy(c.Policy):
		return Invalid("unknown Policy %d; use a consume.Policy constant", c.Policy)
	case c.Mode != InPlace && c.Mode != RetryTopic:
		return Invalid("unknown Mode %d; use InPlace or RetryTopic", c.Mode)
	case c.Mode == RetryTopic && c.RetryTopic == c.Topic:
		return Invalid("RetryTopic must differ from Topic")
	case c.DeadLetter == nil && (c.DeadLetterTopic == c.Topic || c.DeadLetterTopic == c.RetryTopic && c.Mode == RetryTopic):
		return Invalid("DeadLetterTopic must differ from Topic and RetryTopic")
	case c.MaxAttempts < 1:
		return Invalid("MaxAttempts %d must be at least 1", c.MaxAttempts)
	case c.RetryBackoffInitial <= 0 || c.RetryBackoffMax < c.RetryBackoffInitial:
		return Invalid("retry backoff must be positive with RetryBackoffMax >= RetryBackoffInitial")
	case c.CommitInterval <= 0:
		return Invalid("CommitInterval must be positive")
	}
	return nil
}

// Invalid returns an ErrInvalidConfig saying what is wrong, for the
// adapters' checks of their clients' settings.
func Invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(format, args...))
}

// validPolicy reports whether p is one of consume's policies.
func validPolicy(p consume.Policy) bool {
	_, err := consume.ParsePolicy(p.String())
	return err == nil
}

// Topics is what the consumer group subscribes to: Topic, and RetryTopic
// in RetryTopic mode.
func (c Config[R]) Topics() []string {
	if c.Mode == RetryTopic {
		return []string{c.Topic, c.RetryTopic}
	}
	return []string{c.Topic}
}

// retryDelay is the delay after the n-th failed attempt (n >= 1).
func (c *Config[R]) retryDelay(n int) time.Duration {
	return retry.Nth(n, c.RetryBackoffInitial, c.RetryBackoffMax)
}
