package replay

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/position"
)

// Replica is one read replica of a database.
type Replica struct {
	// Name identifies the replica in decisions, logs and metrics
	// (caughtup.replica); unique within its database. Publishers and
	// routers must name it alike.
	Name string
	// Pool connects to the replica. Its config (hooks, TLS, credentials
	// included) is the template of the tracker's one-connection pool and of
	// the pool a consume.Router hands its handlers for this replica.
	Pool *pgxpool.Pool
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
// and replicas. Nothing in caughtup closes these pools; they stay the
// application's.
type Database struct {
	// Primary is required: the tracker reads the epoch and insert
	// position from it, and decisions fall back to it.
	Primary *pgxpool.Pool
	// Replicas may be empty: the database is then always read from the
	// primary.
	Replicas []Replica
}

// ValidateDatabases checks a set of databases as NewTracker, NewPublisher
// and consume.NewRouter take them. Its errors wrap ErrInvalidConfig.
func ValidateDatabases(dbs map[string]Database) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if len(dbs) == 0 {
		return bad("Databases is empty: name at least one database with its primary pool")
	}
	for name, db := range dbs {
		if !position.ValidDatabaseName(name) {
			return bad("database name %q must be 1-63 of [A-Za-z0-9_-] to be carried in tokens", name)
		}
		if db.Primary == nil {
			return bad("database %q has no Primary pool", name)
		}
		seen := make(map[string]bool, len(db.Replicas))
		for i, r := range db.Replicas {
			if r.Name == "" {
				return bad("database %q replica %d has no Name (replay.Replicas names plain pools)", name, i)
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
	return nil
}

// TrackerConfig configures a Tracker. The zero value of every field means
// its documented default; WithDefaults fills them in.
//
// The tracker's role needs pg_monitor (or pg_read_all_stats) and, after a
// failover, the right to read the timeline history file (EXECUTE on
// pg_read_file(text), or superuser); see docs/roles.md. Its connections are named
// ApplicationName.
type TrackerConfig struct {
	// PollInterval is how often each node is queried: one query per node
	// per interval, however many jobs are routed.
	// Default: DefaultPollInterval (100ms).
	// A catch-up is noticed within about one interval, at 10 queries/s per
	// node.
	PollInterval time.Duration

	// WaitPollInterval is the poll period of a replica while something
	// waits on it (Tracker.Watch, a Guard holding a connection), and the
	// closest two polls of one replica ever are.
	// Default: DefaultWaitPollInterval (5ms).
	// A waiting job wakes within about 5ms of the catch-up, at most 200
	// queries/s per awaited replica per process.
	WaitPollInterval time.Duration

	// StalenessBound: an observation older than this is unknown, and an
	// unknown replica is never caught up. It also bounds each query.
	// Default: max(DefaultStalenessBound (1s), 3×PollInterval).
	// Two missed polls are noise; a second of silence is trouble.
	StalenessBound time.Duration

	// MaxLagBytes: a replica further than this behind the primary's
	// insert position is unhealthy, neither used nor waited on.
	// Default: DefaultMaxLagBytes (16 MiB).
	// One WAL segment; a replica further behind will not catch up within a
	// wait (GitLab uses 8 MB).
	MaxLagBytes uint64

	// MaxLagTime: a replica behind in bytes whose last replayed
	// transaction is older than this is unhealthy; time lag alone never
	// counts.
	// Default: DefaultMaxLagTime (60s).
	// GitLab's; an idle primary ages the last transaction of a caught-up
	// replica, so time is never judged alone.
	MaxLagTime time.Duration

	// Feed, if set, takes positions from a position feed that a few
	// Publishers fill (FeedConfig.Source; on Redis, package feed) instead
	// of querying every node. The tracker identifies each node itself
	// first (a replica only when it is first asked about one, so that a
	// fleet started at once does not connect to every replica), and polls
	// by itself whatever the feed does not cover.
	// Default: nil, the tracker polls every node.
	// See FeedConfig and docs/fleet.md.
	Feed *FeedConfig

	// MeterProvider records the tracker's metrics.
	// Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// Logger logs degraded or unknown replica state.
	// Default: slog.Default().
	Logger *slog.Logger
	// Now is the clock observations are stamped with.
	// Default: time.Now.
	Now func() time.Time
}

// Defaults, exported so that documentation and adapters can refer to them.
const (
	DefaultPollInterval     = 100 * time.Millisecond
	DefaultWaitPollInterval = 5 * time.Millisecond
	DefaultStalenessBound   = time.Second
	DefaultMaxLagBytes      = 16 << 20
	DefaultMaxLagTime       = 60 * time.Second
)

// ApplicationName is the application_name of the tracker's and the
// publishers' own connections, so that they can be told apart in
// pg_stat_activity.
const ApplicationName = "caughtup-tracker"

// ErrInvalidConfig is wrapped by every configuration error of this
// package.
var ErrInvalidConfig = errors.New("caughtup/replay: invalid config")

// WithDefaults returns c with every zero field set to its default, the
// global MeterProvider and slog's default logger included. NewTracker
// calls it; it is the one place defaults are filled.
func (c TrackerConfig) WithDefaults() TrackerConfig {
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
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Feed != nil {
		f := c.Feed.withDefaults(c.StalenessBound)
		c.Feed = &f
	}
	return c
}

// Validate checks a config after WithDefaults.
func (c TrackerConfig) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	switch {
	case c.PollInterval < 0, c.WaitPollInterval < 0, c.StalenessBound < 0, c.MaxLagTime < 0:
		return bad("durations must not be negative")
	case c.StalenessBound <= c.PollInterval:
		return bad("StalenessBound %v must exceed PollInterval %v, or every replica would look stale between polls", c.StalenessBound, c.PollInterval)
	case c.WaitPollInterval > c.PollInterval:
		return bad("WaitPollInterval %v must not exceed PollInterval %v", c.WaitPollInterval, c.PollInterval)
	case c.Now == nil:
		return bad("Now is nil; call WithDefaults first")
	}
	if c.Feed != nil {
		return c.Feed.validate(c.StalenessBound)
	}
	return nil
}

// defaultTrackerConfig is what a nil *TrackerConfig means.
var defaultTrackerConfig = TrackerConfig{}.WithDefaults()

// cloneDatabases copies dbs and their replica slices, so that the caller's
// may change afterwards.
func cloneDatabases(dbs map[string]Database) map[string]Database {
	out := make(map[string]Database, len(dbs))
	for name, db := range dbs {
		db.Replicas = slices.Clone(db.Replicas)
		out[name] = db
	}
	return out
}
