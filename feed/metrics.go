package feed

import (
	"context"
	"errors"
	"net"
	"strings"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of every instrument this package
// creates.
const ScopeName = "github.com/caughtup/caughtup/feed"

// Attribute names besides semconv's.
const (
	attrReason = "caughtup.reason"
	attrSource = "caughtup.feed.source"
	attrState  = "caughtup.feed.state"
)

// attrs builds one prebuilt attribute option: the feed's channel and
// Redis as the system, plus kv.
func attrs(channel string, kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(append([]attribute.KeyValue{
		semconv.DBSystemNameRedis, semconv.MessagingDestinationName(channel)}, kv...)...))
}

// errorClass sorts a Redis error into a few error.type values, so the
// attribute sets stay prebuilt.
type errorClass uint8

const (
	errTimeout errorClass = iota
	errConnection
	errServer
	errOther
	numErrorClasses
)

var errorClassNames = [numErrorClasses]string{"timeout", "connection", "redis_error", "_OTHER"}

func classify(err error) errorClass {
	var ne net.Error
	var re redis.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()):
		return errTimeout
	case errors.As(err, &re):
		return errServer
	case errors.Is(err, redis.ErrClosed) || errors.As(err, &ne) || strings.Contains(err.Error(), "connection"):
		return errConnection
	}
	return errOther
}

type publisherMetrics struct {
	published metric.Int64Counter
	failed    metric.Int64Counter
	dropped   metric.Int64Counter
	pending   metric.Int64ObservableGauge

	all         metric.MeasurementOption
	failedBy    [numErrorClasses]metric.MeasurementOption
	superseded  metric.MeasurementOption
	backlogFull metric.MeasurementOption
}

func newPublisherMetrics(mp metric.MeterProvider, channel string) (*publisherMetrics, error) {
	meter := mp.Meter(ScopeName)
	m := &publisherMetrics{
		all:         attrs(channel),
		superseded:  attrs(channel, attribute.String(attrReason, "superseded")),
		backlogFull: attrs(channel, attribute.String(attrReason, "backlog")),
	}
	for i := range m.failedBy {
		m.failedBy[i] = attrs(channel, semconv.ErrorTypeKey.String(errorClassNames[i]))
	}
	var err error
	if m.published, err = meter.Int64Counter("caughtup.feed.published",
		metric.WithUnit("{message}"),
		metric.WithDescription("Observations stored and published on the feed (Redis acknowledged the pipeline).")); err != nil {
		return nil, err
	}
	if m.failed, err = meter.Int64Counter("caughtup.feed.publish.failures",
		metric.WithUnit("{message}"),
		metric.WithDescription("Observations whose pipeline failed (error.type); the next poll of the node replaces them.")); err != nil {
		return nil, err
	}
	if m.dropped, err = meter.Int64Counter("caughtup.feed.publish.dropped",
		metric.WithUnit("{observation}"),
		metric.WithDescription("Observations never sent (reason superseded: a newer one of the same node replaced it while Redis was busy; backlog: MaxPending nodes were already waiting).")); err != nil {
		return nil, err
	}
	if m.pending, err = meter.Int64ObservableGauge("caughtup.feed.publish.pending",
		metric.WithUnit("{observation}"),
		metric.WithDescription("Observations waiting to be sent.")); err != nil {
		return nil, err
	}
	return m, nil
}

type subscriberMetrics struct {
	received    metric.Int64Counter
	rejected    metric.Int64Counter
	duplicates  metric.Int64Counter
	transitions metric.Int64Counter
	state       metric.Int64ObservableGauge

	all        metric.MeasurementOption
	live       metric.MeasurementOption
	stored     metric.MeasurementOption
	rejectedBy [numRejectReasons]metric.MeasurementOption
	stateIs    [numStates]metric.MeasurementOption
}

func newSubscriberMetrics(mp metric.MeterProvider, channel string) (*subscriberMetrics, error) {
	meter := mp.Meter(ScopeName)
	m := &subscriberMetrics{
		all:    attrs(channel),
		live:   attrs(channel, attribute.String(attrSource, "live")),
		stored: attrs(channel, attribute.String(attrSource, "stored")),
	}
	for i := range m.rejectedBy {
		m.rejectedBy[i] = attrs(channel, attribute.String(attrReason, rejectReason(i).String()))
	}
	for i := range m.stateIs {
		m.stateIs[i] = attrs(channel, attribute.String(attrState, State(i).String()))
	}
	var err error
	if m.received, err = meter.Int64Counter("caughtup.feed.received",
		metric.WithUnit("{message}"),
		metric.WithDescription("Authentic observations delivered to the subscriber's callback, by source (live: pub/sub; stored: latest values read on (re)subscribing).")); err != nil {
		return nil, err
	}
	if m.rejected, err = meter.Int64Counter("caughtup.feed.rejected",
		metric.WithUnit("{message}"),
		metric.WithDescription("Messages rejected and never delivered, by reason (unsigned, malformed, unsupported_version, unknown_key, bad_signature, replayed, bad_expiry).")); err != nil {
		return nil, err
	}
	if m.duplicates, err = meter.Int64Counter("caughtup.feed.duplicates",
		metric.WithUnit("{message}"),
		metric.WithDescription("Live copies of observations already delivered from the stored values while (re)subscribing; expected, not delivered twice.")); err != nil {
		return nil, err
	}
	if m.transitions, err = meter.Int64Counter("caughtup.feed.health.transitions",
		metric.WithUnit("{transition}"),
		metric.WithDescription("Subscriber health changes, by the state entered.")); err != nil {
		return nil, err
	}
	if m.state, err = meter.Int64ObservableGauge("caughtup.feed.health.state",
		metric.WithUnit("1"),
		metric.WithDescription("1 for the subscriber's current health state, 0 for the others.")); err != nil {
		return nil, err
	}
	return m, nil
}
