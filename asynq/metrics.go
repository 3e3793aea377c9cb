package asynq

import (
	"context"
	"fmt"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of the instruments this package
// creates. Routing decisions themselves are counted by the consume
// package (caughtup.consume.decisions).
const ScopeName = "github.com/caughtup/caughtup/asynq"

// Override names a routing change the middleware made on its own, as the
// caughtup.asynq.override attribute of caughtup.asynq.overrides. String
// gives the attribute's value.
type Override uint8

const (
	// OverrideLastAttempt: a Delayed task on its last attempt (asynq's
	// retry count has reached MaxRetry, so any error archives it) found no
	// replica within its wait and was routed again as Sticky, a caught-up
	// replica or else the primary, instead of being deferred. The router
	// counted the deferral it was about to make
	// (caughtup.consume.decisions, outcome deferred); subtract these.
	OverrideLastAttempt Override = iota
	// OverrideDeadline: as OverrideLastAttempt, for a task whose absolute
	// deadline (asynq.Deadline) would pass before a deferral brought it
	// back.
	OverrideDeadline
	// OverrideDeadlineUnknown: as OverrideDeadline, for a task whose
	// context deadline is near and which the middleware could not tell
	// from a Timeout (no HeaderDeadline, no Inspector or the lookup
	// failed); it assumed the deadline was absolute. Enqueue through
	// Client, or run the middleware with an Inspector (NewServer does), to
	// avoid these.
	OverrideDeadlineUnknown
	// OverrideCapped: the fallback cap refused the primary to a task on
	// its last attempt or near its deadline; it read the primary anyway,
	// because failing it would lose the job.
	OverrideCapped
	// OverrideDedupCapture: the primary's position for a deduplicated
	// task (HeaderDedup) could not be read, so it ran on the primary.
	OverrideDedupCapture

	numOverrides = int(OverrideDedupCapture) + 1
)

var overrideNames = [numOverrides]string{
	OverrideLastAttempt:     "last_attempt",
	OverrideDeadline:        "deadline",
	OverrideDeadlineUnknown: "deadline_unknown",
	OverrideCapped:          "capped",
	OverrideDedupCapture:    "dedup_capture_failed",
}

// String is the override's name in metrics and logs ("last_attempt", …).
func (o Override) String() string {
	if int(o) < len(overrideNames) {
		return overrideNames[o]
	}
	return "Override(" + strconv.Itoa(int(o)) + ")"
}

// MarshalText implements encoding.TextMarshaler, so that JSON logs carry
// the name.
func (o Override) MarshalText() ([]byte, error) { return []byte(o.String()), nil }

// Hook names a ServerConfig hook, as the caughtup.asynq.hook attribute of
// caughtup.asynq.hooks.missing.
type Hook uint8

const (
	// HookIsFailure: asynq judged a deferral without ServerConfig's
	// IsFailure, so the deferral cost the task a retry.
	HookIsFailure Hook = iota
	// HookRetryDelayFunc: asynq scheduled a deferred task without
	// ServerConfig's RetryDelayFunc, so it came back after asynq's retry
	// backoff instead of the router's delay.
	HookRetryDelayFunc

	numHooks = int(HookRetryDelayFunc) + 1
)

var hookNames = [numHooks]string{HookIsFailure: "IsFailure", HookRetryDelayFunc: "RetryDelayFunc"}

// String is the hook's name in metrics and logs: the asynq.Config field.
func (h Hook) String() string {
	if int(h) < len(hookNames) {
		return hookNames[h]
	}
	return "Hook(" + strconv.Itoa(int(h)) + ")"
}

const (
	attrOverride = "caughtup.asynq.override"
	attrHook     = "caughtup.asynq.hook"
)

// metrics are synchronous instruments whose attribute sets are built once,
// so that counts survive the server's shutdown and two middlewares on one
// MeterProvider add to the same series.
type metrics struct {
	overrides    metric.Int64Counter
	overrideSets [numOverrides]metric.AddOption
	hooks        metric.Int64Counter
	hookSets     [numHooks]metric.AddOption
	unstamped    metric.Int64Counter
	system       metric.AddOption
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	meter := mp.Meter(ScopeName)
	system := semconv.MessagingSystemKey.String("asynq")
	m := &metrics{system: metric.WithAttributeSet(attribute.NewSet(system))}
	var err error
	if m.overrides, err = meter.Int64Counter("caughtup.asynq.overrides",
		metric.WithUnit("{task}"),
		metric.WithDescription("Tasks the asynq middleware routed differently from their policy so that asynq would not archive them or miss a deduplicated write.")); err != nil {
		return nil, fmt.Errorf("caughtup/asynq: creating caughtup.asynq.overrides: %w", err)
	}
	for o := range Override(numOverrides) {
		m.overrideSets[o] = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrOverride, o.String())))
	}
	if m.hooks, err = meter.Int64Counter("caughtup.asynq.hooks.missing",
		metric.WithUnit("{deferral}"),
		metric.WithDescription("Deferrals that asynq handled without caughtupasynq.ServerConfig's hooks: each cost the task a retry (IsFailure) or came back late (RetryDelayFunc). Use caughtupasynq.NewServer.")); err != nil {
		return nil, fmt.Errorf("caughtup/asynq: creating caughtup.asynq.hooks.missing: %w", err)
	}
	for h := range Hook(numHooks) {
		m.hookSets[h] = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrHook, h.String())))
	}
	if m.unstamped, err = meter.Int64Counter("caughtup.asynq.aggregates.unstamped",
		metric.WithUnit("{task}"),
		metric.WithDescription("Aggregated tasks (asynq.GroupAggregator) that could not carry their group's token and read the primary. Build them with caughtupasynq.NewTask.")); err != nil {
		return nil, fmt.Errorf("caughtup/asynq: creating caughtup.asynq.aggregates.unstamped: %w", err)
	}
	return m, nil
}

func (m *metrics) override(ctx context.Context, o Override) {
	m.overrides.Add(ctx, 1, m.overrideSets[o])
}

func (m *metrics) missingHook(ctx context.Context, h Hook) {
	m.hooks.Add(ctx, 1, m.hookSets[h])
}

func (m *metrics) unstampedAggregate(ctx context.Context) {
	m.unstamped.Add(ctx, 1, m.system)
}
