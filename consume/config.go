package consume

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/position"
)

// Replica is one read replica of a database.
type Replica struct {
	// Name identifies the replica in decisions, logs and metrics
	// (caughtup.replica); unique within its database.
	Name string
	// Pool connects to the replica. The tracker makes its own
	// one-connection pool from its config (hooks included); Pool serves
	// the handlers.
	Pool *pgxpool.Pool
	// Guard, if not nil, is the ReplicaGuard installed on Pool's config:
	// the Router feeds it what the tracker sees, which closes the window
	// in which a replica restarted between a job's routing and its read
	// shows less than it had replayed. Optional; see ReplicaGuard.
	Guard *ReplicaGuard
}

// Replicas names plain pools "host:port" after their first configured
// host, or "replica-<i>" when that is not unique.
func Replicas(pools ...*pgxpool.Pool) []Replica {
	out := make([]Replica, len(pools))
	seen := make(map[string]bool, len(pools))
	for i, p := range pools {
		name := ""
		if p != nil {
			cc := p.Config().ConnConfig
			name = net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port)))
		}
		if name == "" || seen[name] {
			name = "replica-" + strconv.Itoa(i)
		}
		seen[name] = true
		out[i] = Replica{Name: name, Pool: p}
	}
	return out
}

// Database is one logical database (the name tokens use) with its primary
// and replicas. The Router never closes these pools; they stay the
// application's.
type Database struct {
	// Primary is required. Decisions fall back to it, DB returns it for
	// databases the token does not name, and the tracker reads the epoch
	// and insert position from it.
	Primary *pgxpool.Pool
	// Replicas may be empty: the database is then always read from the
	// primary (ReasonNoReplicas).
	Replicas []Replica
}

// Config configures a Router. The zero value of every field but Databases
// means its documented default; WithDefaults fills them in.
//
// The tracker's roles need pg_monitor (pg_stat_wal_receiver shows
// received_tli only to pg_read_all_stats; without it every replica's epoch
// is unknown and every job reads the primary; it also shows the startup
// process's start, which tells a crash restart from progress) and, after a
// failover, the right to pg_read_file the timeline history (superuser or
// pg_read_server_files; without it tokens from before the failover read
// the primary and a standby left on the old timeline is not recognized as
// diverged). Its connections are named TrackerApplicationName.
type Config struct {
	// Databases maps the logical names tokens carry to pools. Required.
	Databases map[string]Database

	// DefaultPolicy applies to jobs routed with PolicyDefault. Default
	// Delayed: most jobs run milliseconds after their producer committed,
	// when replicas are usually a few milliseconds behind, and Delayed
	// absorbs that in a short wait instead of sending the job to the
	// primary as Sticky would (GitLab defaults to Always, which offloads
	// nothing).
	DefaultPolicy Policy

	// PollInterval is how often the tracker queries each replica and each
	// primary: exactly one query per node per interval, however many
	// decisions are made, and faster only while a job waits on that
	// replica. Default 100ms: a replica that catches up is noticed within
	// about one interval by jobs that are not waiting, at 10 queries/s per
	// node.
	PollInterval time.Duration

	// WaitPollInterval is the poll period for a replica while at least one
	// job waits on it (or a ReplicaGuard holds a connection to it). It is
	// also the closest two polls of one replica ever are: however many
	// jobs wait, and however often new ones arrive (a new waiter makes the
	// tracker poll at once only if the last poll is that old), a replica
	// costs each process at most 1/WaitPollInterval queries per second.
	// Default 5ms, so at most 200 queries/s per awaited replica per
	// process: a waiting job wakes within about 5ms of the replica
	// passing its token (well inside the 500ms WaitBudget, and two orders
	// of magnitude below GitLab's 100-500ms sleeps), while the load stays
	// a small fraction of a replica core even with many worker processes
	// waiting at once. The old default, 1ms, cost 500-1,500 queries/s per
	// process (BenchmarkWaitLoad; issue reports) for a gain of a few
	// milliseconds.
	WaitPollInterval time.Duration

	// StalenessBound: an observation older than this is unknown, and an
	// unknown replica is never caught up. It also bounds each tracker
	// query. Default max(1s, 3×PollInterval): two missed polls are noise,
	// a second of silence means the replica or the tracker is in trouble.
	StalenessBound time.Duration

	// MaxLagBytes: a replica whose replay is more than this many WAL bytes
	// behind the primary's insert position is unhealthy and neither used
	// nor waited on. Default 16 MiB (GitLab uses 8 MB): one WAL segment is
	// 16 MiB, and a replica further behind than that will not catch up
	// within a wait budget.
	MaxLagBytes uint64

	// MaxLagTime: a replica is also unhealthy when it is behind in bytes
	// (more than 0) and its last replayed transaction is older than this,
	// while WAL it received waits to be replayed. Time lag alone never
	// counts, and a replica that has replayed all it received has none: on
	// an idle primary the last transaction grows old while the replica is
	// caught up, and the few bytes of a checkpoint or a standby snapshot
	// record that it has yet to receive do not make it unhealthy. Default
	// 60s (GitLab's).
	MaxLagTime time.Duration

	// WaitBudget bounds how long a Delayed job waits in process for a
	// replica before it is deferred. Negative disables waiting. Default
	// 500ms: ordinary streaming lag is milliseconds, so half a second
	// absorbs bursts and checkpoint hiccups while holding a worker only
	// briefly; anything longer is real lag, better served by a deferral
	// (asynq moves due tasks only every 5s) than by a blocked worker.
	// GitLab sleeps up to 1.5s.
	WaitBudget time.Duration

	// MaxAge: once a token is older than this, a Delayed job stops being
	// deferred and reads the primary (ReasonDeadline). It bounds every
	// deferral, which is why deferrals need not count as failed attempts
	// (measured from the producer's capture time: a token captured ahead
	// of the consumer's clock, within ClockSkewTolerance, is deferred
	// for at most MaxAge plus its skew). Default 2m: several deferral steps, yet short enough that a stuck
	// replica delays work by minutes, not hours.
	MaxAge time.Duration

	// ClockSkewTolerance is how far ahead of the consumer's clock a
	// token's capture time may be and still count as captured just now
	// (age 0): a producer's clock is as often a little ahead of the
	// consumer's as behind. A capture time further ahead is not trusted:
	// the token's age counts as unknown, as for a token without a capture
	// time, so a Delayed job that no replica can serve waits its
	// WaitBudget and then reads the primary under the fallback cap
	// (ReasonUnknownAge) instead of being deferred; the decision reports
	// the skew (Decision.ClockSkew), caughtup.consume.tokens.future counts
	// it and a rate-limited warning logs it. Clamping such a time to now
	// would bound nothing, since asynq retries and Kafka retry topics
	// decide every attempt afresh and the token would look new on each
	// for as long as the skew lasts. Default 5s: far above what
	// NTP-synchronized hosts differ by (ntpd and chrony step a clock
	// that is more than 128ms off), small beside MaxAge, which a token
	// within the tolerance can outlast by at most the tolerance, and
	// within asynq's 5s scheduling granularity. Must not be negative.
	ClockSkewTolerance time.Duration

	// DeferInitial, DeferMultiplier and DeferMax shape the deferral delay,
	// computed from the token's age alone (so it needs no attempt
	// counter): the delays of successive deferrals are DeferInitial,
	// ×DeferMultiplier, … capped at DeferMax, and a token of age a gets
	// the delay of the step that age has reached; never past MaxAge.
	// Defaults 1s, 2 and 30s: asynq schedules in whole seconds. Decide
	// adds no jitter; adapters may.
	DeferInitial    time.Duration
	DeferMultiplier float64
	DeferMax        time.Duration

	// PrimaryRate and PrimaryBurst cap, per Router (per process), the
	// promotions to the primary caused by lag or unknown replica state.
	// With a FleetBudget the cap stays as a local bound: a promotion must
	// pass both.
	// Missing tokens, Always, epoch changes, unknown databases and
	// databases without replicas are not capped: they read the primary no
	// matter how long they wait. Over the cap, Delayed jobs defer and
	// Sticky jobs get OutcomeCapped. Default 50/s with a burst of 100: the
	// burst absorbs a replica restart or a short stall without refusing
	// anything, while a lasting replica outage adds at most 50 reads/s
	// per worker process to the primary instead of the whole job rate.
	// rate.Inf disables the cap.
	PrimaryRate  rate.Limit
	PrimaryBurst int

	// FleetBudget, if set, is a budget of primary fallback reads shared by
	// every process of the fleet (a *feed.Budget: GCRA in Redis), applied
	// per database (key: the database name) on top of the per-process
	// cap: the promotions PrimaryRate caps must pass both, and
	// OutcomeCapped then means that the fleet budget or the local cap is
	// spent. While the budget cannot answer (Redis slow or unreachable)
	// the per-process cap alone applies; that is logged and counted
	// (caughtup.consume.fallback.budget, result unavailable). Default nil:
	// the per-process cap alone, which multiplies with the number of
	// processes.
	FleetBudget FleetBudget

	// Feed, if set, makes the Router take replica and primary positions
	// from a position feed in Redis, filled by a few publishers
	// (NewPublisher, `caughtup feed`), instead of querying every node
	// itself; it falls back to its own polls, node by node, whenever the
	// feed does not cover a node, and for every node while the feed is
	// silent, unreachable or dropped. See FeedConfig and "Fleet scale" in
	// the package documentation. Default nil: the Router polls.
	Feed *FeedConfig

	// MeterProvider records the metrics. Default otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// Logger logs each decision at Debug and degraded or unknown state at
	// Warn. Default slog.Default().
	Logger *slog.Logger
	// Now is the clock for decisions and observations. Default time.Now.
	Now func() time.Time
}

// Defaults, exported so that documentation and adapters can refer to them.
const (
	DefaultPollInterval       = 100 * time.Millisecond
	DefaultWaitPollInterval   = 5 * time.Millisecond
	DefaultStalenessBound     = time.Second
	DefaultMaxLagBytes        = 16 << 20
	DefaultMaxLagTime         = 60 * time.Second
	DefaultWaitBudget         = 500 * time.Millisecond
	DefaultMaxAge             = 2 * time.Minute
	DefaultClockSkewTolerance = 5 * time.Second
	DefaultDeferInitial       = time.Second
	DefaultDeferMultiplier    = 2.0
	DefaultDeferMax           = 30 * time.Second
	DefaultPrimaryRate        = rate.Limit(50)
	DefaultPrimaryBurst       = 100
)

// WithDefaults returns c with every zero field set to its default. It does
// not fill MeterProvider and Logger with globals; NewRouter does, when it
// starts.
func (c Config) WithDefaults() Config {
	if c.DefaultPolicy == PolicyDefault {
		c.DefaultPolicy = Delayed
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.WaitPollInterval == 0 {
		c.WaitPollInterval = DefaultWaitPollInterval
	}
	if c.StalenessBound == 0 {
		c.StalenessBound = max(DefaultStalenessBound, 3*c.PollInterval)
	}
	if c.MaxLagBytes == 0 {
		c.MaxLagBytes = DefaultMaxLagBytes
	}
	if c.MaxLagTime == 0 {
		c.MaxLagTime = DefaultMaxLagTime
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
	if c.Feed != nil {
		f := c.Feed.withDefaults(c.StalenessBound)
		c.Feed = &f
	}
	return c
}

// ErrInvalidConfig is wrapped by every error Validate returns.
var ErrInvalidConfig = errors.New("caughtup/consume: invalid config")

// Validate checks a config after WithDefaults.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if len(c.Databases) == 0 {
		return bad("Databases is empty: name at least one database with its primary pool")
	}
	guards := make(map[*ReplicaGuard]bool)
	for name, db := range c.Databases {
		if !position.ValidDatabaseName(name) {
			return bad("database name %q must be 1-63 of [A-Za-z0-9_-] to be carried in tokens", name)
		}
		if db.Primary == nil {
			return bad("database %q has no Primary pool", name)
		}
		seen := make(map[string]bool, len(db.Replicas))
		for i, r := range db.Replicas {
			if r.Guard != nil {
				if !r.Guard.installed.Load() {
					return bad("database %q replica %q: its Guard is not installed; call Guard.Install(poolConfig) before pgxpool.NewWithConfig", name, r.Name)
				}
				if guards[r.Guard] {
					return bad("database %q replica %q: one ReplicaGuard serves one replica pool; make one per replica", name, r.Name)
				}
				guards[r.Guard] = true
			}
			if r.Name == "" {
				return bad("database %q replica %d has no Name (consume.Replicas names plain pools)", name, i)
			}
			if seen[r.Name] {
				return bad("database %q has two replicas named %q", name, r.Name)
			}
			seen[r.Name] = true
			if r.Pool == nil {
				return bad("database %q replica %q has no Pool", name, r.Name)
			}
		}
	}
	switch {
	case !c.DefaultPolicy.valid() || c.DefaultPolicy == PolicyDefault:
		return bad("DefaultPolicy %d is not Always, Sticky or Delayed", c.DefaultPolicy)
	case c.PollInterval < 0, c.WaitPollInterval < 0, c.StalenessBound < 0, c.MaxLagTime < 0,
		c.MaxAge < 0, c.ClockSkewTolerance < 0, c.DeferInitial < 0, c.DeferMax < 0:
		return bad("durations must not be negative (only WaitBudget may be, to disable waiting)")
	case c.StalenessBound <= c.PollInterval:
		return bad("StalenessBound %v must exceed PollInterval %v, or every replica would look stale between polls", c.StalenessBound, c.PollInterval)
	case c.WaitPollInterval > c.PollInterval:
		return bad("WaitPollInterval %v must not exceed PollInterval %v", c.WaitPollInterval, c.PollInterval)
	case c.DeferMultiplier < 1:
		return bad("DeferMultiplier %v must be at least 1", c.DeferMultiplier)
	case c.DeferMax < c.DeferInitial:
		return bad("DeferMax %v must be at least DeferInitial %v", c.DeferMax, c.DeferInitial)
	case c.PrimaryRate < 0 || c.PrimaryBurst < 0:
		return bad("PrimaryRate and PrimaryBurst must not be negative (rate.Inf disables the cap)")
	case c.Now == nil:
		return bad("Now is nil; call WithDefaults first")
	}
	if c.Feed != nil {
		return c.Feed.validate(c.StalenessBound)
	}
	return nil
}
