package caughtupasynq

import (
	"context"
	"fmt"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of the instruments and spans this
// package creates. Routing decisions themselves are counted by the consume
// package (caughtup.consume.decisions).
const ScopeName = "github.com/caughtup/caughtup/asynq/caughtupasynq"

// override names why the middleware limited a task's routing, as the
// caughtup.asynq.override attribute of caughtup.asynq.overrides (its values
// are listed in the package documentation).
type override uint8

const (
	overrideNone override = iota
	// overrideLastAttempt: the task was on its last attempt (asynq's retry
	// count had reached MaxRetry, so any error archives it): it could be
	// neither deferred nor refused, and its routing changed for that
	// (consume.ReasonCannotDefer, or held while the cap was spent).
	overrideLastAttempt
	// overrideDeadline: as overrideLastAttempt, for a task whose absolute
	// deadline (asynq.Deadline) would pass before a deferral brought it
	// back.
	overrideDeadline
	// overrideDeadlineUnknown: as overrideDeadline, for a task whose
	// context deadline is near and which the middleware could not tell from
	// a Timeout (no HeaderDeadline, no Inspector or the lookup failed); it
	// assumed the deadline was absolute.
	overrideDeadlineUnknown
	// overrideDedupCapture: the primary's position for a deduplicated task
	// could not be read, so it ran on the primary.
	overrideDedupCapture

	numOverrides = int(overrideDedupCapture) + 1
)

var overrideNames = [numOverrides]string{
	overrideNone:            "none",
	overrideLastAttempt:     "last_attempt",
	overrideDeadline:        "deadline",
	overrideDeadlineUnknown: "deadline_unknown",
	overrideDedupCapture:    "dedup_capture_failed",
}

func (o override) String() string {
	if int(o) < len(overrideNames) {
		return overrideNames[o]
	}
	return "override(" + strconv.Itoa(int(o)) + ")"
}

// hook names a ServerConfig hook, as the caughtup.asynq.hook attribute of
// caughtup.asynq.hooks.missing.
type hook uint8

const (
	// hookIsFailure: asynq judged a deferral without ServerConfig's
	// IsFailure, so the deferral cost the task a retry.
	hookIsFailure hook = iota
	// hookRetryDelayFunc: asynq scheduled a deferred task without
	// ServerConfig's RetryDelayFunc, so it came back after asynq's retry
	// backoff instead of the router's delay.
	hookRetryDelayFunc

	numHooks = int(hookRetryDelayFunc) + 1
)

var hookNames = [numHooks]string{hookIsFailure: "IsFailure", hookRetryDelayFunc: "RetryDelayFunc"}

// String is the hook's name in metrics and logs: the asynq.Config field.
func (h hook) String() string {
	if int(h) < len(hookNames) {
		return hookNames[h]
	}
	return "hook(" + strconv.Itoa(int(h)) + ")"
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
		metric.WithDescription("Tasks whose routing the asynq middleware limited so that asynq would not archive them (last attempt, deadline) or miss a deduplicated write.")); err != nil {
		return nil, fmt.Errorf("caughtup/asynq: creating caughtup.asynq.overrides: %w", err)
	}
	for o := range override(numOverrides) {
		m.overrideSets[o] = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrOverride, o.String())))
	}
	if m.hooks, err = meter.Int64Counter("caughtup.asynq.hooks.missing",
		metric.WithUnit("{deferral}"),
		metric.WithDescription("Deferrals that asynq handled without caughtupasynq.ServerConfig's hooks: each cost the task a retry (IsFailure) or came back late (RetryDelayFunc). Use caughtupasynq.NewServer.")); err != nil {
		return nil, fmt.Errorf("caughtup/asynq: creating caughtup.asynq.hooks.missing: %w", err)
	}
	for h := range hook(numHooks) {
		m.hookSets[h] = metric.WithAttributeSet(attribute.NewSet(system, attribute.String(attrHook, h.String())))
	}
	if m.unstamped, err = meter.Int64Counter("caughtup.asynq.aggregates.unstamped",
		metric.WithUnit("{task}"),
		metric.WithDescription("Aggregated tasks (asynq.GroupAggregator) that could not carry their group's token and read the primary. Build them with caughtupasynq.NewTask.")); err != nil {
		return nil, fmt.Errorf("caughtup/asynq: creating caughtup.asynq.aggregates.unstamped: %w", err)
	}
	return m, nil
}

func (m *metrics) override(ctx context.Context, o override) {
	m.overrides.Add(ctx, 1, m.overrideSets[o])
}

func (m *metrics) missingHook(ctx context.Context, h hook) {
	m.hooks.Add(ctx, 1, m.hookSets[h])
}

func (m *metrics) unstampedAggregate(ctx context.Context) {
	m.unstamped.Add(ctx, 1, m.system)
}
