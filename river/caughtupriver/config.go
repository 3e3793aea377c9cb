package caughtupriver

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// ErrInvalidConfig is wrapped by the errors of Config.Validate and
// NewMiddleware.
var ErrInvalidConfig = errors.New("caughtup/river: invalid config")

// DefaultPositionTimeout is Config.PositionTimeout's default.
const DefaultPositionTimeout = 5 * time.Second

// Config configures a Middleware. The zero value routes every job with the
// router's default policy, against the token in its metadata or else the
// primary's position read after the job was fetched.
type Config struct {
	// Policies sets the policy per job kind (JobArgs.Kind), as GitLab sets a
	// worker's data consistency where the worker is declared. Keys are
	// exact kinds. An empty key, or a value that is not a consume.Policy,
	// is refused.
	// Default: none, every kind gets DefaultPolicy.
	Policies map[string]consume.Policy

	// DefaultPolicy applies to kinds Policies does not name.
	// Default: consume.PolicyDefault, the router's Config.DefaultPolicy
	// (Delayed unless configured otherwise).
	// One setting then governs every adapter in the process.
	DefaultPolicy consume.Policy

	// Database is the router's logical database (a key of
	// consume.Config.Databases) whose primary holds River's jobs: the
	// position read after a fetch is read on its primary and stands for
	// that database in the job's token.
	// Default: enqueue.DefaultDatabase ("main").
	// The name enqueue's Capturer stamps by default, so a job and the
	// tokens producers capture agree.
	Database string

	// UnstampedReadPrimary sends jobs without a token in their metadata to
	// the primary (counted as consume.OutcomePrimaryNoToken), instead of
	// routing them against the primary's position read after their fetch.
	// Default: false.
	// That read costs a round trip to the primary per fetched batch, and
	// is what makes jobs inserted with InsertTx, in the business
	// transaction, readable on a replica at all; set this only when every
	// job that matters is inserted with Insert or InsertMany from this
	// package.
	UnstampedReadPrimary bool

	// PositionTimeout bounds one read of the primary's position for
	// fetched jobs. A read that fails or times out sends the jobs waiting
	// for it to the primary (counted, caughtup.river.tokens fetch_failed).
	// Default: DefaultPositionTimeout (5s).
	// The read is one short query; a primary slower than that is better
	// read directly than waited on.
	PositionTimeout time.Duration

	// WakeCapacity bounds how many snoozed jobs the Middleware remembers
	// to wake: a job snoozed for lag is made available again (its
	// scheduled_at moved to now, in a statement that wakes up to a
	// thousand at once) as soon as a replica has replayed its token,
	// rather than when its snooze ends. A remembered job is forgotten when
	// it comes back to this process, is woken, its snooze has ended, or
	// its River client stops; when the set is full the oldest is
	// forgotten (caughtup.river.wake.dropped, evicted). A forgotten job
	// runs when its snooze ends, as every snoozed job does if the process
	// dies. Negative disables waking. Only clients of the pgx driver
	// (riverpgxv5) are woken.
	// Default: DefaultWakeCapacity (10,000).
	// More jobs than a worker process snoozes in a long replica outage at
	// hundreds of jobs per second, in a few MB.
	WakeCapacity int

	// MeterProvider records caughtup.river.tokens, .position.reads,
	// .overrides and .wake.*.
	// Default: otel.GetMeterProvider().
	// As the OpenTelemetry contrib instrumentations do.
	MeterProvider metric.MeterProvider

	// TracerProvider makes the consume.SpanDefer span of each snooze and
	// the consume.SpanWake span of each wake statement, linked to the
	// snoozes' spans. The routing spans are the router's
	// (consume.Config.TracerProvider); they and the snoozes' are children
	// of the worker's context's span (otelriver's, if its middleware runs
	// before this one).
	// Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider

	// Logger reports, sampled, failed position reads. Malformed metadata
	// tokens are logged by the router (consume.Job.Source "river <kind>").
	// Default: slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns c with every zero field set to its default.
// NewMiddleware calls it.
func (c Config) WithDefaults() Config {
	if c.Database == "" {
		c.Database = enqueue.DefaultDatabase
	}
	if c.PositionTimeout == 0 {
		c.PositionTimeout = DefaultPositionTimeout
	}
	if c.WakeCapacity == 0 {
		c.WakeCapacity = DefaultWakeCapacity
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
	return c
}

// Validate reports policies that name no consume.Policy, an invalid
// database name and a negative timeout. Its errors wrap ErrInvalidConfig.
// Whether Database is one the router knows is checked by NewMiddleware.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if c.DefaultPolicy > consume.Delayed {
		return fmt.Errorf("%w: DefaultPolicy %d is not a consume.Policy: use consume.Always, Sticky, Delayed or PolicyDefault", ErrInvalidConfig, c.DefaultPolicy)
	}
	for k, p := range c.Policies {
		if p > consume.Delayed {
			return fmt.Errorf("%w: Policies[%q] = %d is not a consume.Policy: use consume.Always, Sticky, Delayed or PolicyDefault", ErrInvalidConfig, k, p)
		}
		if strings.TrimSpace(k) == "" {
			return fmt.Errorf("%w: Policies has an empty job kind: key policies by JobArgs.Kind()", ErrInvalidConfig)
		}
	}
	if !position.ValidDatabaseName(c.Database) {
		return fmt.Errorf("%w: Database %q must be 1 to %d of [A-Za-z0-9_-]", ErrInvalidConfig, c.Database, position.MaxDatabaseNameLen)
	}
	if c.PositionTimeout < 0 {
		return fmt.Errorf("%w: PositionTimeout %v is negative", ErrInvalidConfig, c.PositionTimeout)
	}
	return nil
}
