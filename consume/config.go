package consume

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/caughtup/caughtup/internal/typednil"
	"github.com/caughtup/caughtup/replay"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/time/rate"
)

// Config configures a Router. The zero value of every field but Databases
// means its documented default; WithDefaults fills them in.
type Config struct {
	// Databases maps the logical names tokens carry to pools. Required.
	Databases map[string]replay.Database

	// Tracker configures the router's replay.Tracker: poll intervals, the
	// staleness bound, lag thresholds, a position feed.
	// Default: replay.TrackerConfig's defaults, with this config's
	// MeterProvider, Logger and Now.
	Tracker replay.TrackerConfig

	// DefaultPolicy applies to jobs routed with PolicyDefault.
	// Default: Delayed.
	// Replicas are usually milliseconds behind, which a short wait absorbs
	// (GitLab defaults to Always, which offloads nothing).
	DefaultPolicy Policy

	// WaitBudget bounds how long a Delayed job waits in process for a
	// replica before it is deferred. Negative disables waiting.
	// Default: DefaultWaitBudget (500ms).
	// Ordinary lag is milliseconds; longer is real lag, better deferred than
	// holding a worker (GitLab sleeps up to 1.5s).
	WaitBudget time.Duration

	// MaxAge: once a token is older than this (from its capture time), a
	// Delayed job stops being deferred and reads the primary
	// (ReasonDeadline). It bounds every deferral, so deferrals need not
	// count as failed attempts.
	// Default: DefaultMaxAge (2m).
	// Several deferral steps, yet a stuck replica delays work by minutes,
	// not hours.
	MaxAge time.Duration

	// ClockSkewTolerance is how far ahead of the consumer's clock a token's
	// capture time may be and still count as age 0. Further ahead, the age
	// is unknown: the job is not deferred but reads the primary after its
	// wait (ReasonUnknownAge), and the skew is counted and logged. Must not
	// be negative.
	// Default: DefaultClockSkewTolerance (5s).
	// Far above what NTP-synchronized hosts differ by, small beside MaxAge.
	ClockSkewTolerance time.Duration

	// DeferInitial, DeferMultiplier and DeferMax shape the deferral delay,
	// a function of the token's age alone (no attempt counter): DeferInitial,
	// ×DeferMultiplier per step, capped at DeferMax, never past MaxAge.
	// Decide adds no jitter; adapters may.
	// Default: DefaultDeferInitial (1s), DefaultDeferMultiplier (2),
	// DefaultDeferMax (30s).
	// asynq schedules in whole seconds.
	DeferInitial    time.Duration
	DeferMultiplier float64
	DeferMax        time.Duration

	// PrimaryRate and PrimaryBurst cap, per Router (per process), the
	// promotions to the primary caused by lag or unknown replica state;
	// with a FleetBudget a promotion must pass both. Missing tokens,
	// Always, epochs, unknown databases and databases without replicas are
	// not capped. Over the cap a job that can be deferred is, and one that
	// cannot is refused (OutcomeCapped) or held (Job.Hold). rate.Inf
	// disables the cap.
	// Default: DefaultPrimaryRate (50/s), DefaultPrimaryBurst (100).
	// The burst absorbs a restart or a short stall; a lasting outage adds at
	// most 50 reads/s per process to the primary.
	PrimaryRate  rate.Limit
	PrimaryBurst int

	// FleetBudget, if set, is a budget of primary fallback reads shared by
	// every process of the fleet (a *feed.Budget: GCRA in Redis), per
	// database. While it cannot answer, the per-process cap alone applies,
	// which is logged and counted (caughtup.consume.fallback.budget, result
	// unavailable).
	// Default: nil, the per-process cap alone.
	// Per-process caps multiply with the number of processes.
	FleetBudget FleetBudget

	// MeterProvider records the metrics.
	// Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// TracerProvider makes the routing spans: caughtup.route around each
	// Route, with the decision as attributes, and its child caughtup.wait
	// while the job waits inside Route for a replica or the fallback cap
	// (SpanRoute, SpanWait). Only inside a trace: a Route whose context
	// has no span makes none.
	// Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// Logger logs each decision at Debug and degraded or unknown state at
	// Warn.
	// Default: slog.Default().
	Logger *slog.Logger
	// Now is the clock for decisions (and, unless Tracker.Now is set, for
	// observations).
	// Default: time.Now.
	Now func() time.Time
}

// Defaults, exported so that documentation and adapters can refer to them.
const (
	DefaultWaitBudget         = 500 * time.Millisecond
	DefaultMaxAge             = 2 * time.Minute
	DefaultClockSkewTolerance = 5 * time.Second
	DefaultDeferInitial       = time.Second
	DefaultDeferMultiplier    = 2.0
	DefaultDeferMax           = 30 * time.Second
	DefaultPrimaryRate        = rate.Limit(50)
	DefaultPrimaryBurst       = 100
)

// policy is the policy a job routed with p gets: p, or DefaultPolicy for
// PolicyDefault and invalid values.
func (c *Config) policy(p Policy) Policy {
	if p == PolicyDefault || !p.valid() {
		return c.DefaultPolicy
	}
	return p
}

// WithDefaults returns c with every zero field set to its default, the
// global OpenTelemetry providers and slog's default logger included, and
// the tracker's with this config's MeterProvider, Logger and Now where it
// has none. NewRouter calls it; it is the one place defaults are filled.
func (c Config) WithDefaults() Config {
	if c.DefaultPolicy == PolicyDefault {
		c.DefaultPolicy = Delayed
	}
	if c.WaitBudget == 0 {
		c.WaitBudget = DefaultWaitBudget
	}
	if c.MaxAge == 0 {
		c.MaxAge = DefaultMaxAge
	}
	if c.ClockSkewTolerance == 0 {
		c.ClockSkewTolerance = DefaultClockSkewTolerance
	}
	if c.DeferInitial == 0 {
		c.DeferInitial = DefaultDeferInitial
	}
	if c.DeferMultiplier == 0 {
		c.DeferMultiplier = DefaultDeferMultiplier
	}
	if c.DeferMax == 0 {
		c.DeferMax = DefaultDeferMax
	}
	if c.PrimaryRate == 0 {
		c.PrimaryRate = DefaultPrimaryRate
	}
	if c.PrimaryBurst == 0 {
		c.PrimaryBurst = DefaultPrimaryBurst
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.TracerProvider == nil {
		c.TracerProvider = otel.GetTracerProvider()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Tracker.Now == nil {
		c.Tracker.Now = c.Now
	}
	if c.Tracker.MeterProvider == nil {
		c.Tracker.MeterProvider = c.MeterProvider
	}
	if c.Tracker.Logger == nil {
		c.Tracker.Logger = c.Logger
	}
	c.Tracker = c.Tracker.WithDefaults()
	return c
}

// ErrInvalidConfig is wrapped by every error Validate returns.
var ErrInvalidConfig = errors.New("caughtup/consume: invalid config")

// Validate checks a config after WithDefaults.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if err := replay.ValidateDatabases(c.Databases); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if err := c.Tracker.Validate(); err != nil {
		return fmt.Errorf("%w: Tracker: %w", ErrInvalidConfig, err)
	}
	switch {
	case !c.DefaultPolicy.valid() || c.DefaultPolicy == PolicyDefault:
		return bad("DefaultPolicy %d is not Always, Sticky or Delayed", c.DefaultPolicy)
	case c.MaxAge < 0, c.ClockSkewTolerance < 0, c.DeferInitial < 0, c.DeferMax < 0:
		return bad("durations must not be negative (only WaitBudget may be, to disable waiting)")
	case c.DeferMultiplier < 1:
		return bad("DeferMultiplier %v must be at least 1", c.DeferMultiplier)
	case c.DeferMax < c.DeferInitial:
		return bad("DeferMax %v must be at least DeferInitial %v", c.DeferMax, c.DeferInitial)
	case c.PrimaryRate < 0 || c.PrimaryBurst < 0:
		return bad("PrimaryRate and PrimaryBurst must not be negative (rate.Inf disables the cap)")
	case c.FleetBudget != nil && typednil.Is(c.FleetBudget):
		// A nil *feed.Budget (`b, _ := feed.NewBudget(cfg)` after a refused
		// config) is != nil, and Route would panic on the first fallback.
		return bad("FleetBudget is a nil %T: leave the field unset for the per-process cap alone, or give the budget feed.NewBudget returned and check its error", c.FleetBudget)
	case c.Now == nil:
		return bad("Now is nil; call WithDefaults first")
	}
	return nil
}
