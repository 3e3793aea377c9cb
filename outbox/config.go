package outbox

import (
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/internal/typednil"
	"github.com/caughtup/caughtup/position"
)

// DefaultDatabase is the logical database name relays and Stamping put in
// tokens when their config names none (enqueue's default too).
const DefaultDatabase = enqueue.DefaultDatabase

// ErrInvalidConfig is wrapped by every error the configs' Validate
// methods return, and so by NewPollingRelay, NewLogicalRelay and Stamping
// for a config they reject.
var ErrInvalidConfig = errors.New("caughtup/outbox: invalid config")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
}

// Defaults shared by both relays.
const (
	defaultMinBackoff = 100 * time.Millisecond
	defaultMaxBackoff = 5 * time.Second
)

// PollingConfig configures a PollingRelay. The zero value of every field
// but Primary and Publisher means its documented default; WithDefaults
// fills them in.
type PollingConfig struct {
	// Primary connects to the primary that holds the outbox table: a
	// *pgxpool.Pool in production (each batch is one transaction on one
	// connection; *pgx.Conn works for a single relay). Required.
	Primary Beginner
	// Publisher delivers stamped batches: caughtupkafka.NewOutboxPublisher,
	// caughtupasynq.NewOutboxPublisher, or your own. Required.
	Publisher Publisher
	// Database is the logical database name in the tokens, the key
	// consumers use to find this database's replicas. 1 to 63 of
	// [A-Za-z0-9_-].
	// Default: DefaultDatabase ("main").
	// enqueue's default, so that producers and relay agree unconfigured.
	Database string
	// Table is the outbox table, "name" or "schema.name" (see Table).
	// Default: DefaultTable.
	Table string
	// BatchSize is how many rows one transaction claims. Must not be
	// negative.
	// Default: 100.
	// Large enough to amortize the transaction and the position read,
	// small enough that row locks are held only for one publish round
	// trip.
	BatchSize int
	// PollInterval is the pause after a batch that was not full, and so
	// the longest an event waits in an idle outbox. Must not be negative.
	// Default: 100ms.
	// A tenth of a second of latency, at ten cheap index scans per second.
	PollInterval time.Duration
	// KeepPublished sets published_at instead of deleting published rows,
	// for audit trails; prune them yourself.
	// Default: false (delete).
	// The table stays small and the claim query fast.
	KeepPublished bool
	// MinBackoff is the first pause after a failed batch; it doubles per
	// failure up to MaxBackoff. Must not be negative.
	// Default: 100ms.
	// A blip in the broker or the database costs a tenth of a second.
	MinBackoff time.Duration
	// MaxBackoff caps the pause between failed batches. Must not be
	// negative or below MinBackoff.
	// Default: 5s, or MinBackoff if that is larger.
	// A relay whose broker is down retries a dozen times a minute, and
	// resumes within 5s once it is back.
	MaxBackoff time.Duration
	// SystemIDRefresh is how long the system identifier, which is fixed at
	// initdb, is reused before it is read again (enqueue.Config's field of
	// the same name).
	// Default: enqueue.DefaultSystemIDRefresh (1 minute).
	SystemIDRefresh time.Duration
	// Logger receives failed batches (the relay retries them).
	// Default: slog.Default().
	Logger *slog.Logger
	// MeterProvider records the relay's instruments.
	// Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// Now stamps Token.CapturedAt.
	// Default: time.Now.
	Now func() time.Time
}

// WithDefaults returns c with every zero field set to its default.
func (c PollingConfig) WithDefaults() PollingConfig {
	if c.Database == "" {
		c.Database = DefaultDatabase
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.PollInterval == 0 {
		c.PollInterval = 100 * time.Millisecond
	}
	c.MinBackoff, c.MaxBackoff = backoffDefaults(c.MinBackoff, c.MaxBackoff)
	if c.SystemIDRefresh == 0 {
		c.SystemIDRefresh = enqueue.DefaultSystemIDRefresh
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// Validate reports a config NewPollingRelay would reject. Zero fields are
// judged by their defaults.
func (c PollingConfig) Validate() error {
	c = c.WithDefaults()
	if c.Primary == nil {
		return invalid("PollingConfig.Primary is nil: give the pool of the primary that holds the outbox table")
	}
	if typednil.Is(c.Publisher) {
		return invalid("PollingConfig.Publisher is nil (%T): give a publisher, e.g. caughtupkafka.NewOutboxPublisher, and check its error", c.Publisher)
	}
	if err := validDatabase("PollingConfig", c.Database); err != nil {
		return err
	}
	if _, err := parseTable(c.Table); err != nil {
		return invalid("PollingConfig.Table: %w", err)
	}
	if c.BatchSize < 0 {
		return invalid("PollingConfig.BatchSize %d is negative: leave it zero for 100", c.BatchSize)
	}
	if c.PollInterval < 0 {
		return invalid("PollingConfig.PollInterval %v is negative: leave it zero for 100ms", c.PollInterval)
	}
	return validBackoff("PollingConfig", c.MinBackoff, c.MaxBackoff)
}

// LogicalConfig configures a LogicalRelay. The zero value of every field
// but ConnString and Publisher means its documented default; WithDefaults
// fills them in.
type LogicalConfig struct {
	// ConnString reaches the primary's database that holds the outbox
	// table, as a URL or keyword/value string; the relay adds
	// replication=database itself. The role needs the REPLICATION
	// attribute and the right to create a publication on the table.
	// Required.
	ConnString string
	// DialFunc, when set, dials every connection the relay opens (the
	// replication stream, the drain, the row deletes), as pgconn.Config's
	// field of the same name: for proxies, cloud connectors, or a
	// fault-injecting dialer in tests.
	// Default: nil, pgconn's own.
	DialFunc pgconn.DialFunc
	// Publisher delivers stamped batches: caughtupkafka.NewOutboxPublisher,
	// caughtupasynq.NewOutboxPublisher, or your own. Required.
	Publisher Publisher
	// Database is the logical database name in the tokens. 1 to 63 of
	// [A-Za-z0-9_-].
	// Default: DefaultDatabase ("main").
	// enqueue's default, so that producers and relay agree unconfigured.
	Database string
	// Table is the outbox table, "name" or "schema.name" (see Table).
	// Default: DefaultTable.
	Table string
	// Publication is the publication the relay creates (FOR TABLE Table,
	// inserts only) and streams. 1 to 63 of [a-z0-9_].
	// Default: "caughtup_" + the table name.
	// Relays of different tables then do not collide.
	Publication string
	// Slot is the logical replication slot (pgoutput). It keeps every
	// transaction the relay has not confirmed, which is what makes restarts
	// lossless, and also keeps the WAL behind it: monitor
	// pg_replication_slots when the relay is down for long. 1 to 63 of
	// [a-z0-9_].
	// Slot names are the cluster's: relays of the same table in two
	// databases of one cluster need their own (Setup refuses another
	// database's slot with ErrSlotInOtherDatabase).
	// Default: "caughtup_" + the table name.
	// Relays of different tables then do not collide.
	Slot string
	// MaxBatch is how many events are collected before a publish.
	// Transactions are never split, so a batch can exceed it. Must not be
	// negative.
	// Default: 500.
	// A few hundred small messages make one broker round trip.
	MaxBatch int
	// FlushDelay is how long the first committed transaction waits for
	// others to join its batch; when idle it is added to every event's
	// latency. Must not be negative.
	// Default: 5ms.
	// Under load batches fill to MaxBatch long before.
	FlushDelay time.Duration
	// StatusInterval is how often the relay reports its confirmed position
	// even without progress; it must stay well below the server's
	// wal_sender_timeout (60s by default). The relay cannot answer the
	// server while Publisher.Publish runs, so a publish that takes longer
	// than wal_sender_timeout ends the session; it is retried. Must not be
	// negative.
	// Default: 10s.
	// PostgreSQL's own wal_receiver_status_interval.
	StatusInterval time.Duration
	// KeepRows keeps relayed rows in the table, unmarked. Otherwise the
	// relay deletes them after confirming, on a second, ordinary
	// connection.
	// Default: false (delete).
	// Deleting is safe at any time because the stream carries the
	// inserted values; the rows matter only to the one-time drain
	// described on LogicalRelay.
	KeepRows bool
	// MinBackoff is the first pause before a reconnect; it doubles per
	// failed session up to MaxBackoff. Must not be negative.
	// Default: 100ms.
	MinBackoff time.Duration
	// MaxBackoff caps the pause between reconnects. Must not be negative
	// or below MinBackoff.
	// Default: 5s, or MinBackoff if that is larger.
	// A standby instance waiting for the slot, or a relay whose broker is
	// down, retries a dozen times a minute.
	MaxBackoff time.Duration
	// Logger receives reconnects and their reasons.
	// Default: slog.Default().
	Logger *slog.Logger
	// MeterProvider records the relay's instruments.
	// Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

// WithDefaults returns c with every zero field set to its default.
func (c LogicalConfig) WithDefaults() LogicalConfig {
	if c.Database == "" {
		c.Database = DefaultDatabase
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if t, err := parseTable(c.Table); err == nil {
		def := defaultObjectName(t.name)
		if c.Publication == "" {
			c.Publication = def
		}
		if c.Slot == "" {
			c.Slot = def
		}
	}
	if c.MaxBatch == 0 {
		c.MaxBatch = 500
	}
	if c.FlushDelay == 0 {
		c.FlushDelay = 5 * time.Millisecond
	}
	if c.StatusInterval == 0 {
		c.StatusInterval = 10 * time.Second
	}
	c.MinBackoff, c.MaxBackoff = backoffDefaults(c.MinBackoff, c.MaxBackoff)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	return c
}

// Validate reports a config NewLogicalRelay would reject. Zero fields are
// judged by their defaults.
func (c LogicalConfig) Validate() error {
	c = c.WithDefaults()
	if c.ConnString == "" {
		return invalid("LogicalConfig.ConnString is empty: give the primary's database that holds the outbox table")
	}
	if _, err := pgconn.ParseConfig(c.ConnString); err != nil {
		return invalid("LogicalConfig.ConnString: %w", err)
	}
	if typednil.Is(c.Publisher) {
		return invalid("LogicalConfig.Publisher is nil (%T): give a publisher, e.g. caughtupkafka.NewOutboxPublisher, and check its error", c.Publisher)
	}
	if err := validDatabase("LogicalConfig", c.Database); err != nil {
		return err
	}
	if _, err := parseTable(c.Table); err != nil {
		return invalid("LogicalConfig.Table: %w", err)
	}
	if !validObjectName(c.Slot) {
		return invalid("LogicalConfig.Slot %q must be 1 to 63 of [a-z0-9_]", c.Slot)
	}
	if !validObjectName(c.Publication) {
		return invalid("LogicalConfig.Publication %q must be 1 to 63 of [a-z0-9_]", c.Publication)
	}
	if c.MaxBatch < 0 {
		return invalid("LogicalConfig.MaxBatch %d is negative: leave it zero for 500", c.MaxBatch)
	}
	if c.FlushDelay < 0 {
		return invalid("LogicalConfig.FlushDelay %v is negative: leave it zero for 5ms", c.FlushDelay)
	}
	if c.StatusInterval < 0 {
		return invalid("LogicalConfig.StatusInterval %v is negative: leave it zero for 10s", c.StatusInterval)
	}
	return validBackoff("LogicalConfig", c.MinBackoff, c.MaxBackoff)
}

func backoffDefaults(lo, hi time.Duration) (time.Duration, time.Duration) {
	if lo == 0 {
		lo = defaultMinBackoff
	}
	if hi == 0 {
		hi = max(defaultMaxBackoff, lo)
	}
	return lo, hi
}

func validBackoff(cfg string, lo, hi time.Duration) error {
	switch {
	case lo < 0 || hi < 0:
		return invalid("%s.MinBackoff %v / MaxBackoff %v: negative; leave them zero for 100ms and 5s", cfg, lo, hi)
	case hi < lo:
		return invalid("%s.MaxBackoff %v is below MinBackoff %v: raise MaxBackoff or leave it zero", cfg, hi, lo)
	}
	return nil
}

func validDatabase(cfg, name string) error {
	if !position.ValidDatabaseName(name) {
		return invalid("%s.Database %q must be 1 to %d of [A-Za-z0-9_-] to be carried in tokens", cfg, name, position.MaxDatabaseNameLen)
	}
	return nil
}

// defaultObjectName turns a table name into a slot-safe name.
func defaultObjectName(table string) string {
	var b strings.Builder
	b.WriteString("caughtup_")
	for _, c := range strings.ToLower(table) {
		if 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '_' {
			b.WriteRune(c)
		} else {
			b.WriteByte('_')
		}
	}
	s := b.String()
	if len(s) > 63 {
		h := fnv.New32a()
		h.Write([]byte(table))
		s = fmt.Sprintf("%s_%08x", s[:54], h.Sum32())
	}
	return s
}

func validObjectName(s string) bool {
	if len(s) == 0 || len(s) > 63 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}
