package kafkatest_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// envelope is the part of a Debezium change event (JSON converter, schemas
// disabled) that caughtup reads.
type envelope struct {
	Before json.RawMessage `json:"before"`
	After  map[string]any  `json:"after"`
	Source struct {
		Version  string  `json:"version"`
		DB       string  `json:"db"`
		Schema   string  `json:"schema"`
		Table    string  `json:"table"`
		TxID     *int64  `json:"txId"`
		LSN      *int64  `json:"lsn"`
		Sequence string  `json:"sequence"`
		Snapshot string  `json:"snapshot"`
		TsMs     int64   `json:"ts_ms"`
		XMin     *uint64 `json:"xmin"`
	} `json:"source"`
	Op   string `json:"op"`
	TsMs int64  `json:"ts_ms"`
}

// TestDebeziumPostgres runs the Debezium PostgreSQL connector on the
// shared Connect worker against a pgtest primary and checks the change
// event of a transaction: one event per row, each carrying source.lsn (the
// row's change record, below the commit) and source.txId (the writing
// transaction). Run with -v to see an envelope.
func TestDebeziumPostgres(t *testing.T) {
	t.Parallel()
	ctx := testContext(t, 4*time.Minute)
	pg := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, pg)
	pool, err := pg.Primary().Pool(ctx, db)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE orders (id bigint PRIMARY KEY, item text NOT NULL, qty int NOT NULL)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO orders VALUES (0, 'before the connector', 1)`)
	require.NoError(t, err)

	c := kafkatest.SharedConnect(t)
	src, err := kafkatest.PostgresFromDSN(pg.Primary().DSN(db))
	require.NoError(t, err)
	began := time.Now()
	conn := kafkatest.NewPostgresConnector(t, c, kafkatest.DebeziumPostgres{Postgres: src, Tables: []string{"public.orders"}})
	t.Logf("connector %s streaming after %v (snapshot included)", conn.Name, time.Since(began).Round(time.Millisecond))

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	var xid int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&xid))
	_, err = tx.Exec(ctx, `INSERT INTO orders VALUES (1, 'apple', 3), (2, 'pear', 5)`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	var insertText string
	require.NoError(t, pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&insertText))
	afterCommit, err := position.ParseLSN(insertText)
	require.NoError(t, err)

	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: c.Brokers(), Topic: conn.Topic("orders"), Partition: 0, MaxWait: 100 * time.Millisecond,
	})
	defer func() { require.NoError(t, r.Close()) }()

	// The snapshot row first (op "r"), then the transaction's two rows.
	var events []envelope
	for len(events) < 3 {
		m, err := r.ReadMessage(ctx)
		require.NoError(t, err, "reading %s", conn.Topic("orders"))
		var e envelope
		require.NoError(t, json.Unmarshal(m.Value, &e), "%s", m.Value)
		if len(events) == 1 {
			t.Logf("key %s\nvalue %s", m.Key, indent(m.Value))
		}
		events = append(events, e)
	}
	require.Equal(t, "r", events[0].Op)
	require.NotEqual(t, "false", events[0].Source.Snapshot, "a snapshot read says which part of the snapshot it is")
	for i, e := range events[1:] {
		require.Equal(t, "c", e.Op)
		require.Nil(t, jsonNull(e.Before))
		require.EqualValues(t, i+1, e.After["id"])
		require.Equal(t, db, e.Source.DB)
		require.Equal(t, "public", e.Source.Schema)
		require.Equal(t, "orders", e.Source.Table)
		require.NotNil(t, e.Source.TxID, "source.txId")
		require.NotNil(t, e.Source.LSN, "source.lsn")
		require.Equal(t, xid, *e.Source.TxID, "source.txId is the writing transaction")
		lsn := position.LSN(uint64(*e.Source.LSN))
		// Design fact 2: the change record's position, below the commit,
		// so not a safe token by itself.
		require.Less(t, uint64(lsn), uint64(afterCommit), "source.lsn %s below the insert position after COMMIT %s", lsn, afterCommit)
		require.NotEmpty(t, e.Source.Sequence, "source.sequence")
	}
	require.Less(t, *events[1].Source.LSN, *events[2].Source.LSN)
}

func jsonNull(m json.RawMessage) any {
	if len(m) == 0 || string(m) == "null" {
		return nil
	}
	return string(m)
}

func indent(b []byte) string {
	var v any
	if json.Unmarshal(b, &v) != nil {
		return string(b)
	}
	out, _ := json.MarshalIndent(v, "", "  ")
	return string(out)
}
