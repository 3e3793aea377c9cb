package outbox

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/caughtup/caughtup/cdc"
	"github.com/caughtup/caughtup/position"
)

// outboxColumns maps the outbox columns to their positions in a relation.
type outboxColumns struct {
	id, eventID, topic, key, payload, headers, createdAt int
	types                                                []uint32
}

func columnsOf(rel *pglogrepl.RelationMessage) outboxColumns {
	c := outboxColumns{id: -1, eventID: -1, topic: -1, key: -1, payload: -1, headers: -1, createdAt: -1}
	c.types = make([]uint32, len(rel.Columns))
	for i, col := range rel.Columns {
		c.types[i] = col.DataType
		switch col.Name {
		case "id":
			c.id = i
		case "event_id":
			c.eventID = i
		case "topic":
			c.topic = i
		case "key":
			c.key = i
		case "payload":
			c.payload = i
		case "headers":
			c.headers = i
		case "created_at":
			c.createdAt = i
		}
	}
	return c
}

func (s *stream) handleWAL(ctx context.Context, wal []byte) error {
	if len(wal) == 0 {
		return nil
	}
	switch pglogrepl.MessageType(wal[0]) {
	case pglogrepl.MessageTypeRelation, pglogrepl.MessageTypeBegin, pglogrepl.MessageTypeInsert, pglogrepl.MessageTypeCommit:
	default:
		return nil // types, origins, updates, deletes: not ours
	}
	msg, err := pglogrepl.Parse(wal)
	if err != nil {
		return fmt.Errorf("decode pgoutput message %q: %w", wal[0], err)
	}
	switch m := msg.(type) {
	case *pglogrepl.RelationMessage:
		if m.RelationName == s.r.table.name && (s.r.table.schema == "" || m.Namespace == s.r.table.schema) {
			s.relations[m.RelationID] = columnsOf(m)
		}
	case *pglogrepl.BeginMessage:
		s.inTx = true
		s.txEvents = s.txEvents[:0]
	case *pglogrepl.InsertMessage:
		cols, ok := s.relations[m.RelationID]
		if !ok || m.Tuple == nil {
			return nil
		}
		s.txEvents = append(s.txEvents, s.decodeRow(cols, m.Tuple))
	case *pglogrepl.CommitMessage:
		s.inTx = false
		if len(s.txEvents) > 0 {
			// The transaction's end position, never CommitLSN: see
			// cdc.TransactionToken.
			st := newStamper(cdc.TransactionToken(s.r.cfg.Database, s.epoch, position.LSN(m.TransactionEndLSN), m.CommitTime))
			for _, ev := range s.txEvents {
				stamped, err := st.stamp(ev)
				if err != nil {
					unstamped(ctx, s.r.cfg.Logger, s.r.metrics, stamped, err)
				}
				s.pending = append(s.pending, stamped)
			}
		}
		s.txEvents = s.txEvents[:0]
		if m.TransactionEndLSN > s.pendingEnd {
			s.pendingEnd = m.TransactionEndLSN
		}
		if s.flushAt.IsZero() {
			s.flushAt = time.Now().Add(s.r.cfg.FlushDelay)
		}
	}
	return nil
}

func (s *stream) decodeRow(c outboxColumns, t *pglogrepl.TupleData) Event {
	var ev Event
	col := func(i int) *pglogrepl.TupleDataColumn {
		if i < 0 || i >= len(t.Columns) || t.Columns[i].DataType != pglogrepl.TupleDataTypeText {
			return nil
		}
		return t.Columns[i]
	}
	if x := col(c.id); x != nil {
		ev.Seq, _ = strconv.ParseInt(string(x.Data), 10, 64)
	}
	if x := col(c.eventID); x != nil {
		ev.ID = string(x.Data)
	}
	if x := col(c.topic); x != nil {
		ev.Topic = string(x.Data)
	}
	if x := col(c.key); x != nil {
		_ = s.typeMap.Scan(c.types[c.key], pgtype.TextFormatCode, x.Data, &ev.Key)
	}
	if x := col(c.payload); x != nil {
		_ = s.typeMap.Scan(c.types[c.payload], pgtype.TextFormatCode, x.Data, &ev.Payload)
	}
	if x := col(c.headers); x != nil {
		ev.Headers = parseHeaders(x.Data)
	}
	if x := col(c.createdAt); x != nil {
		_ = s.typeMap.Scan(c.types[c.createdAt], pgtype.TextFormatCode, x.Data, &ev.CreatedAt)
	}
	return ev
}
