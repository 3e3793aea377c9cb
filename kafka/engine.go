package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
)

// Client is a Kafka client library as the Engine uses it, for records of
// type R (the library's: *kafka.Message, *kgo.Record) whose headers are
// of type H. Fetching and committing are the adapter's (Source,
// Committer): libraries differ most there.
type Client[R any, H Header] interface {
	// Place returns where r was read.
	Place(r R) Place
	// Headers returns r's headers, by pointer so that a trace carrier
	// over them costs no allocation. The Engine never writes them.
	Headers(r R) *[]H
	// Produce writes a record with r's key and value and the headers hs to
	// topic, and returns once the broker has acknowledged it. After an
	// error the Engine calls it again, after a backoff, until it succeeds
	// or ctx ends.
	Produce(ctx context.Context, topic string, r R, hs []H) error
}

// SpanContexter is implemented by a Client whose library can put a span
// on a record itself (franz-go's kotel plugin, in Record.Context): that
// span wins over the trace context in the record's headers.
type SpanContexter[R any] interface {
	// SpanContext returns the span the library put on r, or the zero
	// SpanContext.
	SpanContext(r R) trace.SpanContext
}

// Place is where a record was read: its topic, partition and offset, and
// the leader epoch of that offset (-1 when the library does not say).
type Place struct {
	Topic       string
	Partition   int32
	Offset      int64
	LeaderEpoch int32
}

// RecordToken is a record's token as read once per delivery: every
// attempt routes it again. Err is the reason the record has no usable
// token (the router reads it from the primary); Verify, when not nil,
// vouches for the replica the router chose (consume.Job.Verify).
type RecordToken struct {
	Token  position.Token
	Err    error
	Verify consume.Verifier
}

// Adapter is what a client adapter gives New besides the Config: its
// name and scope, its client, and its handler.
type Adapter[R any, H Header] struct {
	// Name starts the Engine's log lines and errors ("caughtup/kafka").
	Name string
	// Scope is the instrumentation scope of the Engine's instruments and
	// spans: the adapter's ScopeName.
	Scope string
	// Client reads records and produces to the retry and dead-letter
	// topics. Required.
	Client Client[R, H]
	// Handler runs each record with its routed context. Required.
	Handler func(ctx context.Context, r R) error
	// Token, when set, reads a record's token instead of its
	// position.HeaderName headers (a Debezium envelope's source position).
	Token func(ctx context.Context, r R) RecordToken
}

// Engine is the processing loop both Kafka adapters run: each record of
// a partition routed (consume.Tally.Route), handled, held in place or
// republished to the retry topic while no replica can serve it, retried
// after a handler error and dead-lettered after the last, in offset
// order, with its result counted and its deferral traced. The adapter
// owns the group (assignments, revocations), fetching (Source) and
// committing (Committer); a Partition joins the two.
type Engine[R any, H Header] struct {
	cfg     Config[R]
	lib     Client[R, H]
	spans   SpanContexter[R] // lib's, if it has them
	handler func(context.Context, R) error
	token   func(context.Context, R) RecordToken
	name    string
	log     *slog.Logger
	tracer  trace.Tracer
	prop    propagation.TextMapPropagator
	met     map[string]*topicCounter

	running atomic.Bool
}

// New validates cfg (after WithDefaults) and returns an Engine that
// routes each record with cfg.Router and runs a.Handler. A nil Client or
// Handler is an ErrInvalidConfig.
func New[R any, H Header](cfg Config[R], a Adapter[R, H]) (*Engine[R, H], error) {
	if a.Client == nil || a.Handler == nil {
		return nil, Invalid("the handler is nil")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e := &Engine[R, H]{cfg: cfg, lib: a.Client, handler: a.Handler, token: a.Token, name: a.Name,
		log: cfg.Logger, prop: cfg.Propagators}
	e.spans, _ = a.Client.(SpanContexter[R])
	e.tracer = cfg.TracerProvider.Tracer(a.Scope)
	var err error
	if e.met, err = newTopics(cfg.MeterProvider, a.Scope, cfg.Topics()); err != nil {
		return nil, fmt.Errorf("%s: creating instruments: %w", a.Name, err)
	}
	return e, nil
}

// ErrRunning is returned by an adapter's Consumer.Run while another Run
// of the same Consumer is still going.
var ErrRunning = errors.New("caughtup/kafka: Consumer.Run is already running; use one Consumer per Run, or wait for the first to return")

// Begin starts a Run of the adapter's consumer, one at a time: it returns
// ErrRunning while another is going, else the Run's context, a child of
// ctx, and end, which cancels it and marks the Run over.
func (e *Engine[R, H]) Begin(ctx context.Context) (context.Context, func(), error) {
	if !e.running.CompareAndSwap(false, true) {
		return nil, nil, ErrRunning
	}
	ctx, cancel := context.WithCancel(ctx)
	return ctx, func() {
		cancel()
		e.running.Store(false)
	}, nil
}

// Config returns the Engine's configuration with defaults applied.
func (e *Engine[R, H]) Config() Config[R] { return e.cfg }

// Logger is the Engine's logger, for the adapter's own lines.
func (e *Engine[R, H]) Logger() *slog.Logger { return e.log }

type attemptKey struct{}

// Attempt returns how many times the handler already failed on the record
// being handled in ctx: 0 on the first attempt. Deferrals (waiting for a
// replica) never count, nor do runs a failing replica spoiled
// (consume.ReplicaFailed). In RetryTopic mode the count travels with the
// record in HeaderAttempts.
func Attempt(ctx context.Context) int {
	n, _ := ctx.Value(attemptKey{}).(int)
	return n
}
