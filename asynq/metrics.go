package asynq

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of the instruments this package
// creates. Routing decisions themselves are counted by the consume
// package (caughtup.consume.decisions).
const ScopeName = "github.com/caughtup/caughtup/asynq"

// Override names a routing change the middleware made on its own, as the
// caughtup.asynq.override attribute of caughtup.asynq.overrides.
type Override string

const (
	// OverrideLastAttempt: a Delayed task on its last attempt (asynq's
	// retry count has reached MaxRetry, so any error archives it) found no
	// replica within its wait and was routed again as Sticky, a caught-up
	// replica or else the primary, instead of being deferred. The router
	// counted the deferral it was about to make
	// (caughtup.consume.decisions, outcome deferred); subtract these.
	OverrideLastAttempt Override = "last_attempt"
	// OverrideDeadline: as OverrideLastAttempt, for a task whose
	// deadline would pass before a deferral brought it back.
	OverrideDeadline Override = "deadline"
	// OverrideCapped: the fallback cap refused the primary to a task on
	// its last attempt or near its deadline; it read the primary anyway,
	// because failing it would lose the job.
	OverrideCapped Override = "capped"
	// OverrideDedupCapture: the primary's position for a deduplicated
	// task (HeaderDedup) could not be read, so it ran on the primary.
	OverrideDedupCapture Override = "dedup_capture_failed"
)

const attrOverride = "caughtup.asynq.override"

type metrics struct {
	overrides metric.Int64Counter
	// One attribute set per override, built once.
	sets map[Override]metric.AddOption
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	m := &metrics{sets: make(map[Override]metric.AddOption)}
	var err error
	m.overrides, err = mp.Meter(ScopeName).Int64Counter("caughtup.asynq.overrides",
		metric.WithUnit("{task}"),
		metric.WithDescription("Tasks the asynq middleware routed differently from their policy so that asynq would not archive them or miss a deduplicated write."))
	if err != nil {
		return nil, err
	}
	for _, o := range []Override{OverrideLastAttempt, OverrideDeadline, OverrideCapped, OverrideDedupCapture} {
		m.sets[o] = metric.WithAttributeSet(attribute.NewSet(
			semconv.MessagingSystemKey.String("asynq"),
			attribute.String(attrOverride, string(o)),
		))
	}
	return m, nil
}

func (m *metrics) add(ctx context.Context, o Override) {
	m.overrides.Add(ctx, 1, m.sets[o])
}

// sampler lets one warning through per interval: degraded states tend to
// hit every task at once, the counter counts each.
type sampler struct {
	next atomic.Int64 // UnixNano before which warnings are dropped
}

func (s *sampler) allow(now time.Time, every time.Duration) bool {
	n := s.next.Load()
	if now.UnixNano() < n {
		return false
	}
	return s.next.CompareAndSwap(n, now.Add(every).UnixNano())
}

func (s *sampler) warn(ctx context.Context, log *slog.Logger, msg string, attrs ...slog.Attr) {
	if !log.Enabled(ctx, slog.LevelWarn) || !s.allow(time.Now(), 10*time.Second) {
		return
	}
	log.LogAttrs(ctx, slog.LevelWarn, msg, attrs...)
}
