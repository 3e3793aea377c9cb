package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// drainedMarker is the publication comment that says the rows written
// before the slot were drained.
const drainedMarker = "caughtup outbox relay: rows written before the slot was created have been relayed"

func closeConn(conn *pgconn.PgConn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// simpleQuery runs sql in the simple protocol, the only one a replication
// connection speaks, and returns the text of the first result's rows.
func simpleQuery(ctx context.Context, conn *pgconn.PgConn, sql string) ([][][]byte, error) {
	results, err := conn.Exec(ctx, sql).ReadAll()
	if err != nil {
		return nil, err
	}
	if len(results) == 0 {
		return nil, nil
	}
	return results[0].Rows, results[0].Err
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

func isCode(err error, code string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == code
}

// ErrSlotInOtherDatabase is returned by LogicalRelay.Setup, and logged by
// Run on each reconnect, when LogicalConfig.Slot names a slot of another
// database of the cluster: replication slot names are cluster-wide, and a
// logical slot decodes only the database it was created in.
var ErrSlotInOtherDatabase = errors.New("caughtup/outbox: the replication slot belongs to another database")

// setup makes sure the publication and the slot exist and that rows from
// before the slot have been drained; it returns the slot's confirmed
// position.
func (r *LogicalRelay) setup(ctx context.Context, conn *pgconn.PgConn) (pglogrepl.LSN, error) {
	pub := quoteLiteral(r.cfg.Publication)
	rows, err := simpleQuery(ctx, conn, "SELECT 1 FROM pg_publication WHERE pubname = "+pub)
	if err != nil {
		return 0, fmt.Errorf("caughtup/outbox: look up publication: %w", err)
	}
	if len(rows) == 0 {
		// The publication must exist before the slot: pgoutput reads it
		// with the catalog as of each decoded transaction.
		_, err := simpleQuery(ctx, conn, "CREATE PUBLICATION "+pgx.Identifier{r.cfg.Publication}.Sanitize()+
			" FOR TABLE "+r.table.ident()+" WITH (publish = 'insert')")
		if err != nil && !isCode(err, pgerrcode.DuplicateObject) {
			return 0, fmt.Errorf("caughtup/outbox: create publication %s: %w", r.cfg.Publication, err)
		}
	}
	slotRows, err := simpleQuery(ctx, conn, "SELECT confirmed_flush_lsn::text, database, current_database() FROM pg_replication_slots WHERE slot_name = "+quoteLiteral(r.cfg.Slot))
	if err != nil {
		return 0, fmt.Errorf("caughtup/outbox: look up slot: %w", err)
	}
	if len(slotRows) == 1 && len(slotRows[0]) == 3 && string(slotRows[0][1]) != string(slotRows[0][2]) {
		// Slot names are the cluster's, a logical slot decodes one
		// database: START_REPLICATION would fail on every reconnect.
		return 0, fmt.Errorf("%w: slot %s decodes database %q, this relay's is %q; give each database's relay its own LogicalConfig.Slot (or tear the other relay down)",
			ErrSlotInOtherDatabase, r.cfg.Slot, slotRows[0][1], slotRows[0][2])
	}
	if len(slotRows) == 0 {
		// A new slot needs a new drain: clear the marker first, so that a
		// crash between creating the slot and finishing the drain leaves
		// it unset and the next start drains again.
		if _, err := simpleQuery(ctx, conn, "COMMENT ON PUBLICATION "+pgx.Identifier{r.cfg.Publication}.Sanitize()+" IS NULL"); err != nil {
			return 0, fmt.Errorf("caughtup/outbox: reset drain marker: %w", err)
		}
		_, err := pglogrepl.CreateReplicationSlot(ctx, conn, r.cfg.Slot, "pgoutput",
			pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: "NOEXPORT_SNAPSHOT"})
		if err != nil && !isCode(err, pgerrcode.DuplicateObject) {
			return 0, fmt.Errorf("caughtup/outbox: create slot %s: %w", r.cfg.Slot, err)
		}
		r.cfg.Logger.InfoContext(ctx, "caughtup/outbox: created logical replication slot", "slot", r.cfg.Slot, "publication", r.cfg.Publication)
		slotRows, err = simpleQuery(ctx, conn, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = "+quoteLiteral(r.cfg.Slot))
		if err != nil {
			return 0, fmt.Errorf("caughtup/outbox: look up slot: %w", err)
		}
	}
	var confirmed pglogrepl.LSN
	if len(slotRows) == 1 && len(slotRows[0]) == 1 && slotRows[0][0] != nil {
		confirmed, _ = pglogrepl.ParseLSN(string(slotRows[0][0]))
	}
	marker, err := simpleQuery(ctx, conn, "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = "+pub)
	if err != nil {
		return 0, fmt.Errorf("caughtup/outbox: read drain marker: %w", err)
	}
	if len(marker) == 1 && marker[0][0] != nil && string(marker[0][0]) == drainedMarker {
		return confirmed, nil
	}
	if err := r.drain(ctx); err != nil {
		return 0, err
	}
	return confirmed, nil
}
