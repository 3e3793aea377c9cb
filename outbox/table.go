package outbox

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/caughtup/caughtup/position"
)

// DefaultTable is the outbox table every function and relay uses unless
// told otherwise.
const DefaultTable = "outbox"

// HeaderEventID is the header that carries Event.ID on published messages,
// next to position.HeaderName: the key consumers dedupe on, since every
// relay here delivers at least once.
const HeaderEventID = "caughtup-event-id"

//go:embed schema.sql
var schemaSQL string

// Event is one outbox row: what the producer writes inside its transaction
// and what a relay hands to a Publisher.
type Event struct {
	// ID is the deduplication key: a random UUID unless the producer set
	// one (an idempotency key it already has). Relays deliver at least once,
	// so consumers that must not act twice remember IDs they have handled.
	ID string
	// Seq is the row's bigserial id, set by relays. It orders events of one
	// table, but only roughly: ids are assigned at INSERT, rows become
	// visible at COMMIT.
	Seq int64
	// Topic is the Kafka topic or the asynq task type. Required.
	Topic string
	// Key is the Kafka message key; nil for none.
	Key []byte
	// Payload is the message body.
	Payload []byte
	// Headers are copied to the published message. Relays add
	// position.HeaderName (the token) and HeaderEventID.
	Headers map[string]string
	// Token is set by relays: the token the published
	// Headers[position.HeaderName] carries, a position at or past the
	// commit of the transaction that wrote the row, merged with any token
	// the producer put there (position.MergeHeader). When the producer's
	// header does not decode it is published unchanged, and Token is
	// zero: unknown stays unknown, and consumers read the primary.
	Token position.Token
	// CreatedAt is the row's created_at, set by relays.
	CreatedAt time.Time
}

// Table names an outbox table other than DefaultTable: "name" (resolved
// through search_path) or "schema.name". Each part is 1 to 63 bytes and
// may hold any character but '.' and NUL; names are quoted, so case
// matters ("app.Events" is app."Events"). The package-level Migrate and
// Insert use DefaultTable.
//
//	var events = outbox.Table("app.events")
//
//	func setUp(ctx context.Context, pool *pgxpool.Pool) error { // once, at startup or in a migration
//		return events.Migrate(ctx, pool)
//	}
//
//	func insertOrder(ctx context.Context, tx pgx.Tx, body []byte) (string, error) {
//		return events.Insert(ctx, tx, outbox.Event{Topic: "orders", Payload: body})
//	}
type Table string

// tableName is a parsed, quotable table name.
type tableName struct {
	schema, name string
}

// parseTable accepts "name" or "schema.name"; quoting happens on output,
// so any characters but '.' and NUL are allowed in each part.
func parseTable(s string) (tableName, error) {
	if s == "" {
		s = DefaultTable
	}
	parts := strings.Split(s, ".")
	bad := len(parts) > 2 || strings.IndexByte(s, 0) >= 0
	for _, p := range parts {
		if p == "" || len(p) > 63 {
			bad = true
		}
	}
	if bad {
		return tableName{}, fmt.Errorf("table name %q: want \"name\" or \"schema.name\", each part 1 to 63 bytes without NUL", s)
	}
	if len(parts) == 1 {
		return tableName{name: parts[0]}, nil
	}
	return tableName{schema: parts[0], name: parts[1]}, nil
}

func (t tableName) ident() string {
	if t.schema == "" {
		return pgx.Identifier{t.name}.Sanitize()
	}
	return pgx.Identifier{t.schema, t.name}.Sanitize()
}

// indexIdent is the partial index's name. An index lives in its table's
// schema, so the name is never qualified; long table names are shortened
// with a hash so the 63-byte limit cannot truncate two names into one.
func (t tableName) indexIdent() string {
	n := t.name + "_unpublished_idx"
	if len(n) > 63 {
		h := fnv.New32a()
		h.Write([]byte(t.name))
		n = fmt.Sprintf("%s_%08x_unpub_idx", t.name[:40], h.Sum32())
	}
	return pgx.Identifier{n}.Sanitize()
}

// String is the name as the user wrote it, for messages.
func (t tableName) String() string {
	if t.schema == "" {
		return t.name
	}
	return t.schema + "." + t.name
}

// Beginner starts transactions on the primary: *pgxpool.Pool, *pgx.Conn
// and pgx.Tx (a savepoint) satisfy it. Migrate and the polling relay need
// nothing else.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate creates the outbox table DefaultTable and its index if they do
// not exist; see Table.Migrate.
func Migrate(ctx context.Context, db Beginner) error {
	return Table(DefaultTable).Migrate(ctx, db)
}

// Migrate creates the outbox table and its index if they do not exist. It
// is idempotent and safe to run concurrently from several processes (it
// takes a transaction-scoped advisory lock derived from the table name),
// so applications may call it on every start. Run it before the first
// Insert; for the logical relay, before the first event is written is
// best (see LogicalRelay).
func (tb Table) Migrate(ctx context.Context, db Beginner) error {
	t, err := parseTable(string(tb))
	if err != nil {
		return fmt.Errorf("caughtup/outbox: %w", err)
	}
	sql := strings.NewReplacer("__TABLE__", t.ident(), "__INDEX__", t.indexIdent()).Replace(schemaSQL)
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("caughtup/outbox: migrate %s: %w", t, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// CREATE ... IF NOT EXISTS is not atomic against a concurrent CREATE
	// (both can pass the check and one fails on the catalog's unique
	// index); the lock serializes migrators of the same table.
	h := fnv.New64a()
	h.Write([]byte("caughtup/outbox:" + t.String()))
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", int64(h.Sum64())); err != nil {
		return fmt.Errorf("caughtup/outbox: migrate %s: %w", t, err)
	}
	for _, stmt := range splitStatements(sql) {
		if _, err := tx.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("caughtup/outbox: migrate %s: %w", t, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("caughtup/outbox: migrate %s: %w", t, err)
	}
	return nil
}

// splitStatements splits the embedded schema on ';' at line ends; it holds
// no string literal or function body that could contain one.
func splitStatements(sql string) []string {
	var out []string
	for _, s := range strings.SplitAfter(sql, ";\n") {
		var b strings.Builder
		for line := range strings.Lines(s) {
			if !strings.HasPrefix(strings.TrimSpace(line), "--") {
				b.WriteString(line)
			}
		}
		if stmt := strings.TrimSpace(b.String()); stmt != "" {
			out = append(out, stmt)
		}
	}
	return out
}

// ErrNoTopic is returned by Insert for an event without a topic, which no
// publisher could route.
var ErrNoTopic = errors.New("caughtup/outbox: Event.Topic is required")

// Insert writes ev into the outbox table DefaultTable inside the caller's
// transaction; see Table.Insert.
func Insert(ctx context.Context, tx pgx.Tx, ev Event) (string, error) {
	return Table(DefaultTable).Insert(ctx, tx, ev)
}

// Insert writes ev into the outbox inside the caller's transaction and
// returns its ID (ev.ID, or a new random UUID). The event is published
// only if tx commits, and a relay stamps it with a token at or past that
// commit, which the row itself cannot carry: its own commit position does
// not exist yet while it is being inserted.
//
// ev.Seq, ev.Token and ev.CreatedAt are ignored.
func (tb Table) Insert(ctx context.Context, tx pgx.Tx, ev Event) (string, error) {
	if ev.Topic == "" {
		return "", ErrNoTopic
	}
	t, err := parseTable(string(tb))
	if err != nil {
		return "", fmt.Errorf("caughtup/outbox: %w", err)
	}
	id := ev.ID
	if id == "" {
		id = newUUID()
	}
	headers := ev.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	payload := ev.Payload
	if payload == nil {
		payload = []byte{}
	}
	_, err = tx.Exec(ctx, "INSERT INTO "+t.ident()+" (event_id, topic, key, payload, headers) VALUES ($1, $2, $3, $4, $5)",
		id, ev.Topic, ev.Key, payload, headers)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable {
			return "", fmt.Errorf("caughtup/outbox: table %s does not exist; run outbox.Migrate first: %w", t, err)
		}
		return "", fmt.Errorf("caughtup/outbox: insert into %s: %w", t, err)
	}
	return id, nil
}

// newUUID returns a random (version 4) UUID. Generating it here rather than
// with gen_random_uuid() lets Insert return it without a RETURNING round
// trip and keeps the module free of a UUID dependency.
func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	var s [36]byte
	hex.Encode(s[0:8], b[0:4])
	s[8] = '-'
	hex.Encode(s[9:13], b[4:6])
	s[13] = '-'
	hex.Encode(s[14:18], b[6:8])
	s[18] = '-'
	hex.Encode(s[19:23], b[8:10])
	s[23] = '-'
	hex.Encode(s[24:], b[10:])
	return string(s[:])
}
