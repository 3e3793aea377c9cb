package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/caughtup/caughtup/position"
)

// stream is one replication session's state.
type stream struct {
	r         *LogicalRelay
	conn      *pgconn.PgConn
	epoch     position.Epoch
	typeMap   *pgtype.Map
	relations map[uint32]outboxColumns

	inTx       bool
	txEvents   []Event
	pending    []Event
	pendingEnd pglogrepl.LSN
	flushAt    time.Time
	confirmed  pglogrepl.LSN
	nextStatus time.Time
	published  bool

	cleaner *pgx.Conn
}

func (s *stream) run(ctx context.Context) error {
	cfg := s.r.cfg
	s.nextStatus = time.Now().Add(cfg.StatusInterval)
	for {
		now := time.Now()
		if s.pendingEnd > s.confirmed && (len(s.pending) >= cfg.MaxBatch || !now.Before(s.flushAt)) {
			if err := s.flush(ctx); err != nil {
				return err
			}
			continue
		}
		if !now.Before(s.nextStatus) {
			if err := s.sendStatus(); err != nil {
				return err
			}
		}
		deadline := s.nextStatus
		if s.pendingEnd > s.confirmed && s.flushAt.Before(deadline) {
			deadline = s.flushAt
		}
		rctx, cancel := context.WithDeadline(ctx, deadline)
		msg, err := s.conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("receive: %w", err)
		}
		switch msg := msg.(type) {
		case *pgproto3.CopyData:
			if err := s.handleCopyData(ctx, msg.Data); err != nil {
				return err
			}
		case *pgproto3.ErrorResponse:
			return pgconn.ErrorResponseToPgError(msg)
		case *pgproto3.CopyDone:
			return errors.New("the server ended the replication stream")
		}
	}
}

func (s *stream) handleCopyData(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return err
		}
		// Between transactions with nothing unpublished, everything below
		// the server's sent position has been handled: confirming it lets
		// the slot release WAL of unrelated traffic, which pgoutput does
		// not send at all.
		if !s.inTx && s.pendingEnd <= s.confirmed && pkm.ServerWALEnd > s.confirmed {
			s.confirmed = pkm.ServerWALEnd
			s.pendingEnd = s.confirmed
		}
		s.r.cfg.Logger.Debug("caughtup/outbox: keepalive", "slot", s.r.cfg.Slot, "server_wal_end", pkm.ServerWALEnd, "reply_requested", pkm.ReplyRequested, "confirmed", s.confirmed)
		if pkm.ReplyRequested {
			return s.sendStatus()
		}
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return err
		}
		return s.handleWAL(ctx, xld.WALData)
	}
	return nil
}

// flush publishes the pending transactions and only then confirms their
// end position to the slot.
func (s *stream) flush(ctx context.Context) error {
	events := s.pending
	if len(events) > 0 {
		began := time.Now()
		if err := s.r.cfg.Publisher.Publish(ctx, events); err != nil {
			return &RelayError{Stage: stagePublish, Err: err}
		}
		s.r.metrics.published(ctx, len(events), time.Since(began))
		s.published = true
	}
	s.confirmed = s.pendingEnd
	if err := s.sendStatus(); err != nil {
		return err
	}
	if !s.r.cfg.KeepRows && len(events) > 0 {
		s.deleteRows(ctx, events)
	}
	s.pending = nil
	s.flushAt = time.Time{}
	return nil
}

func (s *stream) sendStatus() error {
	s.nextStatus = time.Now().Add(s.r.cfg.StatusInterval)
	if s.confirmed == 0 {
		return nil
	}
	s.r.cfg.Logger.Debug("caughtup/outbox: confirmed", "slot", s.r.cfg.Slot, "lsn", s.confirmed)
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: s.confirmed, WALFlushPosition: s.confirmed, WALApplyPosition: s.confirmed,
	})
	if err != nil {
		return fmt.Errorf("standby status update: %w", err)
	}
	return nil
}

// deleteRows removes relayed rows. It is housekeeping: a failure is logged
// and the rows stay, harmlessly, because the slot has moved past them.
func (s *stream) deleteRows(ctx context.Context, events []Event) {
	ids := make([]int64, 0, len(events))
	for _, ev := range events {
		if ev.Seq != 0 {
			ids = append(ids, ev.Seq)
		}
	}
	if len(ids) == 0 {
		return
	}
	if s.cleaner == nil || s.cleaner.IsClosed() {
		c, err := pgx.ConnectConfig(ctx, s.r.regular.Copy())
		if err != nil {
			s.r.cfg.Logger.WarnContext(ctx, "caughtup/outbox: cannot delete relayed rows", "error", err)
			return
		}
		s.cleaner = c
	}
	if _, err := s.cleaner.Exec(ctx, "DELETE FROM "+s.r.table.ident()+" WHERE id = ANY($1)", ids); err != nil {
		s.r.cfg.Logger.WarnContext(ctx, "caughtup/outbox: cannot delete relayed rows", "error", err)
	}
}
