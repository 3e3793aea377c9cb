package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of every instrument this package
// creates.
const ScopeName = "github.com/caughtup/caughtup/outbox"

// Attribute names on metrics, besides the semconv ones.
const (
	attrRelay    = "caughtup.relay"
	attrDatabase = "caughtup.database"
	attrStage    = "caughtup.stage"
)

// Stages of a relay step, as RelayError.Stage and the caughtup.stage
// attribute name them.
const (
	stageClaim       = "claim"
	stageStamp       = "stamp"
	stagePublish     = "publish"
	stageMark        = "mark"
	stageReplication = "replication"
)

// relayMetrics counts with synchronous instruments, so that counts
// survive Run returning. The attribute set of successful publishes is
// built once per relay; those of failures once per (stage, error type),
// a small set in practice, on first use.
type relayMetrics struct {
	events  metric.Int64Counter
	errors  metric.Int64Counter
	publish metric.Float64Histogram
	base    []attribute.KeyValue
	ok      metric.MeasurementOption

	mu     sync.Mutex
	failed map[failureKey]metric.MeasurementOption
}

type failureKey struct{ stage, errType string }

func newRelayMetrics(mp metric.MeterProvider, relay, database string) (*relayMetrics, error) {
	meter := mp.Meter(ScopeName)
	m := &relayMetrics{
		base: []attribute.KeyValue{
			semconv.DBSystemNamePostgreSQL,
			attribute.String(attrRelay, relay),
			attribute.String(attrDatabase, database),
		},
		failed: map[failureKey]metric.MeasurementOption{},
	}
	m.ok = metric.WithAttributeSet(attribute.NewSet(m.base...))
	var err error
	if m.events, err = meter.Int64Counter("caughtup.outbox.relay.events",
		metric.WithUnit("{event}"),
		metric.WithDescription("Events published and acknowledged by the broker, by relay (polling, logical); republished events count again.")); err != nil {
		return nil, err
	}
	if m.errors, err = meter.Int64Counter("caughtup.outbox.relay.errors",
		metric.WithUnit("{error}"),
		metric.WithDescription("Failed relay steps, by stage (claim, stamp, publish, mark, replication): failed batches are retried with backoff; an event whose token cannot be merged into its header goes out with the header unchanged.")); err != nil {
		return nil, err
	}
	if m.publish, err = meter.Float64Histogram("caughtup.outbox.relay.publish.duration",
		metric.WithUnit("s"),
		metric.WithDescription("Time the Publisher took for one batch."),
		metric.WithExplicitBucketBoundaries(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *relayMetrics) published(ctx context.Context, n int, took time.Duration) {
	ctx = context.WithoutCancel(ctx)
	m.events.Add(ctx, int64(n), m.ok)
	m.publish.Record(ctx, took.Seconds(), m.ok)
}

func (m *relayMetrics) failure(ctx context.Context, stage string, err error) {
	k := failureKey{stage, errorType(err)}
	m.mu.Lock()
	opt, ok := m.failed[k]
	if !ok {
		attrs := append(append(make([]attribute.KeyValue, 0, len(m.base)+2), m.base...),
			attribute.String(attrStage, k.stage), semconv.ErrorTypeKey.String(k.errType))
		opt = metric.WithAttributeSet(attribute.NewSet(attrs...))
		m.failed[k] = opt
	}
	m.mu.Unlock()
	m.errors.Add(context.WithoutCancel(ctx), 1, opt)
}

// errorType is a low-cardinality error.type: the Go type of the innermost
// error, or "canceled"/"timeout".
func errorType(err error) string {
	switch {
	case err == nil:
		return "none"
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	}
	for {
		u := errors.Unwrap(err)
		if u == nil {
			return fmt.Sprintf("%T", err)
		}
		err = u
	}
}
