package outbox

import (
	"github.com/cenkalti/backoff/v4"

	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// DefaultDatabase is the logical database name relays stamp when their
// Config names none (enqueue's default too).
const DefaultDatabase = "main"

// PollingConfig configures a PollingRelay. Zero fields take the documented
// defaults.
type PollingConfig struct {
	// DB connects to the primary that holds the outbox table: a
	// *pgxpool.Pool in production (each batch is one transaction on one
	// connection). Required.
	DB DB
	// Publisher delivers stamped batches. Required.
	Publisher Publisher
	// Database is the logical database name in the tokens, the key
	// consumers use to find this database's replicas. Default "main".
	Database string
	// Table is the outbox table, "name" or "schema.name". Default
	// DefaultTable.
	Table string
	// BatchSize is how many rows one transaction claims. Default 100: large
	// enough to amortize the transaction and the LSN read, small enough
	// that row locks are held only for one publish round trip.
	BatchSize int
	// PollInterval is the pause after a batch that was not full. Default
	// 100ms: an event waits at most that long in an idle outbox, at ten
	// cheap index scans per second.
	PollInterval time.Duration
	// KeepPublished sets published_at instead of deleting published rows,
	// for audit trails; prune them yourself. Default false (delete): the
	// table stays small and the claim query fast.
	KeepPublished bool
	// MinBackoff and MaxBackoff bound the exponential pause after a failed
	// batch. Defaults 100ms and 5s.
	MinBackoff, MaxBackoff time.Duration
	// SystemIDRefresh is how long the system identifier, which is fixed at
	// initdb, is reused before it is read again. Default 1 minute.
	SystemIDRefresh time.Duration
	// Logger receives failed batches (the relay retries them). Default
	// slog.Default().
	Logger *slog.Logger
	// MeterProvider for the relay's instruments. Default: the global one.
	MeterProvider metric.MeterProvider
	// Now stamps Token.CapturedAt. Default time.Now.
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
	if c.BatchSize <= 0 {
		c.BatchSize = 100
	}
	if c.PollInterval <= 0 {
		c.PollInterval = 100 * time.Millisecond
	}
	if c.MinBackoff <= 0 {
		c.MinBackoff = 100 * time.Millisecond
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = 5 * time.Second
	}
	if c.MaxBackoff < c.MinBackoff {
		c.MaxBackoff = c.MinBackoff
	}
	if c.SystemIDRefresh <= 0 {
		c.SystemIDRefresh = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// PollingRelay publishes outbox rows by polling: it claims committed rows
// with SELECT … FOR UPDATE SKIP LOCKED, reads the primary's insert LSN,
// publishes, and deletes (or marks) the rows in the same transaction.
//
// # Why the token is safe
//
// The claim runs in READ COMMITTED, so its snapshot shows only rows whose
// transactions had committed — had inserted their commit records into the
// WAL — before the snapshot was taken. pg_current_wal_insert_lsn() is read
// in the next statement, after that snapshot, so it is at or past the end
// of every such commit record: replay >= token on a replica means the
// replica shows every row of the batch. The price is over-approximation:
// the token also covers whatever else was written before the read, so a
// consumer may wait for WAL it does not need (measured in this package's
// tests).
//
// # Several instances
//
// Instances share the table safely: SKIP LOCKED hands each batch to one of
// them, and a batch whose relay dies is unlocked when its transaction
// aborts and claimed again. Delivery is at least once: a crash between the
// publisher's acknowledgement and COMMIT republishes the batch. Order holds
// within a batch; across instances, and for rows whose transactions commit
// out of id order, it does not, so per-key ordering needs a single
// instance.
type PollingRelay struct {
	cfg     PollingConfig
	table   tableName
	claim   string
	mark    string
	metrics *relayMetrics

	// capturer reads the token inside the claiming transaction, with the
	// same query, caching and page-boundary handling as producers use.
	capturer *enqueue.Capturer

	// hooks let tests crash the relay between its steps.
	hooks relayHooks
}

// relayHooks run between relay steps; an error aborts the batch as a crash
// would (no mark, no confirm).
type relayHooks struct {
	afterClaim   func(ctx context.Context, events []Event) error
	afterPublish func(ctx context.Context, events []Event) error
}

// NewPollingRelay validates cfg and returns a relay; Run starts it.
func NewPollingRelay(cfg PollingConfig) (*PollingRelay, error) {
	cfg = cfg.WithDefaults()
	if cfg.DB == nil {
		return nil, errors.New("caughtup/outbox: PollingConfig.DB is required")
	}
	if cfg.Publisher == nil {
		return nil, errors.New("caughtup/outbox: PollingConfig.Publisher is required")
	}
	if !position.ValidDatabaseName(cfg.Database) {
		return nil, fmt.Errorf("caughtup/outbox: PollingConfig.Database %q must be 1 to %d of [A-Za-z0-9_-]", cfg.Database, position.MaxDatabaseNameLen)
	}
	t, err := parseTable(cfg.Table)
	if err != nil {
		return nil, err
	}
	m, err := newRelayMetrics(cfg.MeterProvider, "polling", cfg.Database)
	if err != nil {
		return nil, err
	}
	r := &PollingRelay{cfg: cfg, table: t, metrics: m, capturer: enqueue.NewCapturer(enqueue.Config{
		Database: cfg.Database, SystemIDRefresh: cfg.SystemIDRefresh, Now: cfg.Now,
	})}
	r.claim = "SELECT id, event_id, topic, key, payload, headers, created_at FROM " + t.ident() +
		" WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
	if cfg.KeepPublished {
		r.mark = "UPDATE " + t.ident() + " SET published_at = now() WHERE id = ANY($1)"
	} else {
		r.mark = "DELETE FROM " + t.ident() + " WHERE id = ANY($1)"
	}
	return r, nil
}

// RelayError says which step of a batch failed. Every step is retried by
// Run; RelayOnce returns it for callers that drive batches themselves.
type RelayError struct {
	// Stage is "claim", "stamp", "publish", "mark" or "replication".
	Stage string
	Err   error
}

// Error names the stage and the cause.
func (e *RelayError) Error() string {
	return "caughtup/outbox: relay " + e.Stage + ": " + e.Err.Error()
}

// Unwrap returns the cause.
func (e *RelayError) Unwrap() error { return e.Err }

// Run relays batches until ctx is done, then returns nil. Failed batches
// are logged, counted and retried with exponential backoff; the rows stay
// in the table, so nothing is lost while the broker or the database is
// down.
func (r *PollingRelay) Run(ctx context.Context) error {
	bo := newBackoff(r.cfg.MinBackoff, r.cfg.MaxBackoff)
	for {
		n, err := r.RelayOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		wait := time.Duration(0)
		switch {
		case err != nil:
			wait = bo.NextBackOff()
			r.cfg.Logger.WarnContext(ctx, "caughtup/outbox: polling relay batch failed; retrying",
				"table", r.table.String(), "error", err, "retry_in", wait)
		case n < r.cfg.BatchSize:
			bo.Reset()
			wait = r.cfg.PollInterval
		default:
			bo.Reset()
		}
		if wait > 0 && !sleepCtx(ctx, wait) {
			return nil
		}
	}
}

// RelayOnce claims, stamps, publishes and marks one batch and returns how
// many events it published. Zero with a nil error means the outbox had no
// unclaimed committed rows.
func (r *PollingRelay) RelayOnce(ctx context.Context) (int, error) {
	n, stage, err := r.relayOnce(ctx)
	if err != nil {
		r.metrics.failed(ctx, stage, err)
		return 0, &RelayError{Stage: stage, Err: err}
	}
	return n, nil
}

func (r *PollingRelay) relayOnce(ctx context.Context) (int, string, error) {
	tx, err := r.cfg.DB.Begin(ctx)
	if err != nil {
		return 0, "claim", err
	}
	// Rolling back releases the row locks so another instance, or the next
	// attempt, claims the batch again.
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	events, err := r.claimBatch(ctx, tx)
	if err != nil {
		return 0, "claim", err
	}
	if len(events) == 0 {
		return 0, "", nil
	}
	// The next statement's reads happen after the claim's snapshot: see
	// the type's doc for why that makes the token safe.
	tok, err := r.capturer.CaptureCommitted(ctx, tx)
	if err != nil {
		return 0, "stamp", err
	}
	ids := make([]int64, len(events))
	st := newStamper(tok)
	for i := range events {
		events[i] = st.stamp(events[i])
		ids[i] = events[i].Seq
	}
	if h := r.hooks.afterClaim; h != nil {
		if err := h(ctx, events); err != nil {
			return 0, "publish", err
		}
	}
	began := time.Now()
	if err := r.cfg.Publisher.Publish(ctx, events); err != nil {
		return 0, "publish", err
	}
	r.metrics.published(ctx, len(events), time.Since(began))
	if h := r.hooks.afterPublish; h != nil {
		if err := h(ctx, events); err != nil {
			return 0, "mark", err
		}
	}
	if _, err := tx.Exec(ctx, r.mark, ids); err != nil {
		return 0, "mark", err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, "mark", err
	}
	return len(events), "", nil
}

func (r *PollingRelay) claimBatch(ctx context.Context, tx pgx.Tx) ([]Event, error) {
	rows, err := tx.Query(ctx, r.claim, r.cfg.BatchSize)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	events := make([]Event, 0, r.cfg.BatchSize)
	for rows.Next() {
		var ev Event
		var headers []byte
		if err := rows.Scan(&ev.Seq, &ev.ID, &ev.Topic, &ev.Key, &ev.Payload, &headers, &ev.CreatedAt); err != nil {
			return nil, err
		}
		ev.Headers = parseHeaders(headers)
		events = append(events, ev)
	}
	return events, rows.Err()
}

// parseHeaders reads the headers column leniently: a row written by hand
// with non-string JSON values must not block the outbox, so such values
// are kept as their JSON text.
func parseHeaders(raw []byte) map[string]string {
	if len(raw) == 0 {
		return nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil || len(m) == 0 {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		var s string
		if err := json.Unmarshal(v, &s); err == nil {
			out[k] = s
		} else {
			out[k] = string(v)
		}
	}
	return out
}

// newBackoff doubles from min to max without jitter: a handful of relay
// instances do not stampede, and a predictable pause is easier to reason
// about in logs. It never stops on its own (MaxElapsedTime 0).
func newBackoff(min, max time.Duration) *backoff.ExponentialBackOff {
	return backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(min),
		backoff.WithMaxInterval(max),
		backoff.WithMultiplier(2),
		backoff.WithRandomizationFactor(0),
		backoff.WithMaxElapsedTime(0),
	)
}

// sleepCtx waits d or until ctx is done; false means ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
