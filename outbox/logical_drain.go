package outbox

import (
	"context"
	"fmt"
	"hash/fnv"

	"github.com/jackc/pgx/v5"
)

// drain relays the rows that were in the table before the slot existed.
// It runs after the slot was created, so every row it misses commits
// after the slot's start and is streamed; rows it sees may be streamed as
// well (duplicates, never loss). A session advisory lock makes concurrent
// starting instances drain one after the other, so none sets the marker
// while another still holds an unpublished batch.
func (r *LogicalRelay) drain(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, r.regular.Copy())
	if err != nil {
		return fmt.Errorf("caughtup/outbox: drain connect: %w", err)
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }()
	h := fnv.New64a()
	h.Write([]byte("caughtup/outbox/drain:" + r.cfg.Slot))
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(h.Sum64())); err != nil {
		return fmt.Errorf("caughtup/outbox: drain lock: %w", err)
	}
	var marker *string
	if err := conn.QueryRow(ctx, "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1", r.cfg.Publication).Scan(&marker); err != nil {
		return fmt.Errorf("caughtup/outbox: read drain marker: %w", err)
	}
	if marker != nil && *marker == drainedMarker {
		return nil
	}
	// The drain is a polling relay on this connection, counted as the
	// logical relay's work; its failures are counted once, by Run.
	pr := newPollingRelay(PollingConfig{
		Primary: conn, Publisher: r.cfg.Publisher, Database: r.cfg.Database, Table: r.cfg.Table,
		KeepPublished: r.cfg.KeepRows, BatchSize: r.cfg.MaxBatch, Logger: r.cfg.Logger, MeterProvider: r.cfg.MeterProvider,
	}.WithDefaults(), r.metrics)
	total := 0
	for {
		n, stage, err := pr.relayOnce(ctx)
		if err != nil {
			return &RelayError{Stage: stage, Err: fmt.Errorf("drain: %w", err)}
		}
		total += n
		if n == 0 {
			break
		}
	}
	if _, err := conn.Exec(ctx, "COMMENT ON PUBLICATION "+pgx.Identifier{r.cfg.Publication}.Sanitize()+" IS "+quoteLiteral(drainedMarker)); err != nil {
		return fmt.Errorf("caughtup/outbox: set drain marker: %w", err)
	}
	if total > 0 {
		r.cfg.Logger.InfoContext(ctx, "caughtup/outbox: drained rows written before the slot", "slot", r.cfg.Slot, "events", total)
	}
	return nil
}
