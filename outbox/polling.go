package outbox

import (
	"context"
	"encoding/json"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/internal/retry"
)

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
// consumer may wait for WAL it does not need (BenchmarkPollingTokenOverApproximation
// measures by how much; LogicalRelay's tokens are exact).
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
}

// NewPollingRelay validates cfg and returns a relay; Run starts it. An
// invalid cfg returns an error wrapping ErrInvalidConfig.
func NewPollingRelay(cfg PollingConfig) (*PollingRelay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := newRelayMetrics(cfg.MeterProvider, "polling", cfg.Database)
	if err != nil {
		return nil, err
	}
	return newPollingRelay(cfg, m), nil
}

// newPollingRelay builds a relay from a validated cfg, counting into m
// (the logical relay's drain shares its own).
func newPollingRelay(cfg PollingConfig, m *relayMetrics) *PollingRelay {
	t, _ := parseTable(cfg.Table)
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
	return r
}

// RelayError says which step of a batch failed. Every step is retried by
// Run; RelayOnce returns it for callers that drive batches themselves.
type RelayError struct {
	// Stage is "claim", "stamp", "publish", "mark" or "replication", as
	// the caughtup.stage attribute of caughtup.outbox.relay.errors names
	// it.
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
	bo := retry.Doubling(r.cfg.MinBackoff, r.cfg.MaxBackoff)
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
		if wait > 0 && !retry.Sleep(ctx, wait) {
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
		r.metrics.failure(ctx, stage, err)
		return 0, &RelayError{Stage: stage, Err: err}
	}
	return n, nil
}

func (r *PollingRelay) relayOnce(ctx context.Context) (int, string, error) {
	tx, err := r.cfg.Primary.Begin(ctx)
	if err != nil {
		return 0, stageClaim, err
	}
	// Rolling back releases the row locks so another instance, or the next
	// attempt, claims the batch again. A relay that dies has its
	// transaction rolled back by the server, with the same effect.
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

	events, err := r.claimBatch(ctx, tx)
	if err != nil {
		return 0, stageClaim, err
	}
	if len(events) == 0 {
		return 0, "", nil
	}
	// The next statement's reads happen after the claim's snapshot: see
	// the type's doc for why that makes the token safe.
	tok, err := r.capturer.CaptureCommitted(ctx, tx)
	if err != nil {
		return 0, stageStamp, err
	}
	ids := make([]int64, len(events))
	st := newStamper(tok)
	for i := range events {
		var err error
		if events[i], err = st.stamp(events[i]); err != nil {
			unstamped(ctx, r.cfg.Logger, r.metrics, events[i], err)
		}
		ids[i] = events[i].Seq
	}
	began := time.Now()
	if err := r.cfg.Publisher.Publish(ctx, events); err != nil {
		return 0, stagePublish, err
	}
	r.metrics.published(ctx, len(events), time.Since(began))
	if _, err := tx.Exec(ctx, r.mark, ids); err != nil {
		return 0, stageMark, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, stageMark, err
	}
	return len(events), "", nil
}

// unstamped reports an event published with its producer's header
// unchanged because the relay's token could not be merged into it (see
// stamper.stamp). Its consumers read this database's primary.
func unstamped(ctx context.Context, log *slog.Logger, m *relayMetrics, ev Event, err error) {
	m.failure(ctx, stageStamp, err)
	log.WarnContext(ctx, "caughtup/outbox: event published with its own token header unchanged; its consumers read the primary",
		"event_id", ev.ID, "topic", ev.Topic, "error", err)
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
