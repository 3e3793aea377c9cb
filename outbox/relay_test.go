package outbox

import (
	"context"
	"fmt"
	"hash/fnv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
)

func TestMigrateIdempotentAndConcurrent(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := e.Primary.Exec(ctx, "CREATE SCHEMA app")
	require.NoError(t, err)
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				errs[i] = Migrate(ctx, e.Primary) // default table, migrated again
			} else {
				errs[i] = Table("app.Events").Migrate(ctx, e.Primary)
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	tx, err := e.Primary.Begin(ctx)
	require.NoError(t, err)
	events := Table("app.Events")
	id, err := events.Insert(ctx, tx, Event{Topic: "t", Payload: []byte("x")})
	require.NoError(t, err)
	require.Regexp(t, `^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`, id)
	own, err := events.Insert(ctx, tx, Event{ID: "order-42-created", Topic: "t"})
	require.NoError(t, err)
	require.Equal(t, "order-42-created", own)
	require.NoError(t, tx.Commit(ctx))
	var n int
	require.NoError(t, e.Primary.QueryRow(ctx, `SELECT count(*) FROM app."Events"`).Scan(&n))
	require.Equal(t, 2, n)

	tx, err = e.Primary.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = Insert(ctx, tx, Event{Payload: []byte("x")})
	require.ErrorIs(t, err, ErrNoTopic)
	_, err = Table("nope").Insert(ctx, tx, Event{Topic: "t"})
	require.ErrorContains(t, err, "run outbox.Migrate first")
	_, err = Table("a.b.c").Insert(ctx, tx, Event{Topic: "t"})
	require.ErrorContains(t, err, "schema.name")
}

func TestParseTable(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"":              `"outbox"`,
		"outbox":        `"outbox"`,
		"app.Events":    `"app"."Events"`,
		`we"ird.ta ble`: `"we""ird"."ta ble"`,
	} {
		got, err := parseTable(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got.ident(), in)
	}
	for _, bad := range []string{"a.b.c", ".x", "x.", "a\x00b"} {
		_, err := parseTable(bad)
		assert.Error(t, err, bad)
	}
	long, _ := parseTable("a_very_long_outbox_table_name_that_goes_on_and_on_and_on_forever")
	assert.LessOrEqual(t, len(long.indexIdent()), 65)
}

func TestPollingRelayPublishesStampedEventsAndMarksThem(t *testing.T) {
	t.Parallel()
	for _, keep := range []bool{false, true} {
		t.Run(map[bool]string{false: "delete", true: "keep"}[keep], func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ids := e.writeOrders(t, ctx, 1, 25)
			// The producer stamped a token for another database; the relay
			// must keep it.
			tx, err := e.Primary.Begin(ctx)
			require.NoError(t, err)
			other, _ := position.New("billing", position.Epoch{SystemID: 9, Timeline: 1}, 0x100, position.SourcePrimary, time.Now()).Encode()
			extra, err := Insert(ctx, tx, Event{Topic: "x", Headers: map[string]string{position.HeaderName: other}})
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
			ids = append(ids, extra)

			var after string
			require.NoError(t, e.Primary.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&after))
			pub := newMemPublisher()
			r, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: pub, BatchSize: 10, KeepPublished: keep, Logger: quiet})
			require.NoError(t, err)
			total := 0
			for {
				n, err := r.RelayOnce(ctx)
				require.NoError(t, err)
				if n == 0 {
					break
				}
				total += n
			}
			require.Equal(t, len(ids), total)
			got := pub.byID()
			sys, err := e.Cluster.Primary().SystemIdentifier(ctx)
			require.NoError(t, err)
			var prevSeq int64
			for i, id := range ids {
				require.Len(t, got[id], 1, id)
				ev := got[id][0]
				require.Equal(t, id, ev.Headers[HeaderEventID])
				require.Greater(t, ev.Seq, prevSeq, "published in id order")
				prevSeq = ev.Seq
				entry, ok := ev.Token.Entry("main")
				require.True(t, ok)
				require.Equal(t, position.SourcePrimary, entry.Source)
				require.Equal(t, sys, entry.Epoch.SystemID)
				require.Equal(t, uint32(1), entry.Epoch.Timeline)
				require.GreaterOrEqual(t, entry.LSN, position.MustParseLSN(after), "token read after the claim")
				require.Equal(t, entry.LSN, tokenLSN(t, ev), "header and Token agree")
				if i < 25 {
					require.Equal(t, "orders", ev.Topic)
					require.Equal(t, string(ev.Key), ev.Headers["order"])
					require.False(t, ev.CreatedAt.IsZero())
				}
			}
			billing, ok := got[extra][0].Token.Entry("billing")
			require.True(t, ok, "producer's token for another database is merged")
			require.Equal(t, position.LSN(0x100), billing.LSN)

			var left, marked int
			require.NoError(t, e.Primary.QueryRow(ctx, "SELECT count(*), count(published_at) FROM outbox").Scan(&left, &marked))
			if keep {
				require.Equal(t, len(ids), left)
				require.Equal(t, len(ids), marked)
			} else {
				require.Zero(t, left)
			}
		})
	}
}

func TestPollingRelaysShareTheTable(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pub := newMemPublisher()
	// Slow publishes keep each batch's rows locked for a while, so the
	// instances really contend.
	pub.setFail(func(int, []Event) error { time.Sleep(2 * time.Millisecond); return nil })
	for range 3 {
		r, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: pub, BatchSize: 7, PollInterval: 5 * time.Millisecond, Logger: quiet})
		require.NoError(t, err)
		runInBackground(t, ctx, r.Run)
	}
	var ids []string
	var mu sync.Mutex
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				id, _, err := e.writeOrder(ctx, int64(w*1000+i))
				assert.NoError(t, err)
				mu.Lock()
				ids = append(ids, id)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	got := pub.waitFor(t, ctx, ids)
	for _, id := range ids {
		require.Len(t, got[id], 1, "SKIP LOCKED hands each row to one instance; no failures, so no duplicates")
	}
}

func TestLogicalRelayStampsTransactionEndLSN(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// A test_decoding slot created before any event reports each
	// transaction's COMMIT at its end position (txn->end_lsn): the
	// reference the relay's tokens must equal.
	ref := uniqueSlot(e.Database + "ref")
	_, err := e.Primary.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'test_decoding')", ref)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = e.Primary.Exec(context.Background(), "SELECT pg_drop_replication_slot($1)", ref)
	})
	pub := newMemPublisher()
	r := newLogical(t, e, LogicalConfig{Publisher: pub})
	require.NoError(t, r.Setup(ctx))

	type written struct {
		ids   []string
		after position.LSN
	}
	var txs []written
	// One, two and three events per transaction.
	for i := range 12 {
		conn, err := e.Primary.Acquire(ctx)
		require.NoError(t, err)
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		var w written
		for j := 0; j <= i%3; j++ {
			id, err := Insert(ctx, tx, Event{Topic: "t", Key: []byte{byte(i)}, Payload: []byte{byte(j)}})
			require.NoError(t, err)
			w.ids = append(w.ids, id)
		}
		require.NoError(t, tx.Commit(ctx))
		var after string
		require.NoError(t, conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&after))
		conn.Release()
		w.after = position.MustParseLSN(after)
		txs = append(txs, w)
	}
	var commits []position.LSN
	rows, err := e.Primary.Query(ctx, `WITH c AS (SELECT * FROM pg_logical_slot_peek_changes($1, NULL, NULL))
		SELECT lsn::text FROM c WHERE data LIKE 'COMMIT%' AND xid IN (SELECT xid FROM c WHERE data LIKE 'table public.outbox:%') ORDER BY lsn`, ref)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		commits = append(commits, position.MustParseLSN(s))
	}
	require.NoError(t, rows.Err())
	require.Len(t, commits, len(txs))

	runInBackground(t, ctx, r.Run)
	var all []string
	for _, w := range txs {
		all = append(all, w.ids...)
	}
	got := pub.waitFor(t, ctx, all)
	sys, err := e.Cluster.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)
	for i, w := range txs {
		for _, id := range w.ids {
			ev := got[id][0]
			entry, ok := ev.Token.Entry("main")
			require.True(t, ok)
			require.Equal(t, position.SourceCDC, entry.Source)
			require.Equal(t, position.Epoch{SystemID: sys, Timeline: 1}, entry.Epoch)
			require.Equal(t, commits[i], entry.LSN, "token is the transaction's end LSN")
			require.LessOrEqual(t, entry.LSN, w.after, "never past the insert LSN read right after COMMIT")
			require.Equal(t, entry.LSN, tokenLSN(t, ev))
		}
		// Every event of one transaction carries the same token.
		first := got[w.ids[0]][0].Token
		for _, id := range w.ids[1:] {
			require.Equal(t, first.Entries, got[id][0].Token.Entries)
		}
	}
}

// newLogical returns a logical relay on e's database and drops its slot
// when the test ends (a slot would keep the database from being dropped).
func newLogical(t testing.TB, e *env, cfg LogicalConfig) *LogicalRelay {
	t.Helper()
	cfg.ConnString = e.Cluster.Primary().DSN(e.Database)
	if cfg.Slot == "" {
		// Slots are cluster-wide; tests run in parallel.
		cfg.Slot = uniqueSlot(e.Database)
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = 10 * time.Millisecond
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 200 * time.Millisecond
	}
	r, err := NewLogicalRelay(cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		// The relay's Run is cancelled by an earlier cleanup; its
		// walsender lets go of the slot soon after.
		if !assert.Eventually(t, func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return r.Teardown(ctx) == nil
		}, 20*time.Second, 20*time.Millisecond, "teardown") {
			t.Logf("teardown: %v", r.Teardown(context.Background()))
		}
	})
	return r
}

func TestLogicalRelayDrainsRowsWrittenBeforeTheSlot(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	before := e.writeOrders(t, ctx, 1, 15)
	pub := newMemPublisher()
	r := newLogical(t, e, LogicalConfig{Publisher: pub})
	require.NoError(t, r.Setup(ctx))
	require.Len(t, pub.snapshot(), len(before), "Setup created the slot and drained what was there")
	after := e.writeOrders(t, ctx, 100, 15)
	runInBackground(t, ctx, r.Run)
	got := pub.waitFor(t, ctx, append(before, after...))
	for _, id := range before {
		require.Len(t, got[id], 1, "the marker keeps Run from draining again")
	}
	for _, id := range before {
		require.Equal(t, position.SourcePrimary, got[id][0].Token.Entries[0].Source, "drained with a polling token")
	}
	for _, id := range after {
		require.Equal(t, position.SourceCDC, got[id][len(got[id])-1].Token.Entries[0].Source, "streamed")
	}
	// Relayed rows are deleted once confirmed.
	require.Eventually(t, func() bool {
		var n int
		return e.Primary.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&n) == nil && n == 0
	}, 10*time.Second, 20*time.Millisecond)
}

func TestLogicalRelayStandbyInstanceTakesOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pub := newMemPublisher()
	first := newLogical(t, e, LogicalConfig{Publisher: pub})
	second := newLogical(t, e, LogicalConfig{Publisher: pub})
	require.NoError(t, first.Setup(ctx))
	stopFirst := runInBackground(t, ctx, first.Run)
	// Wait until the first one holds the slot, then start the second:
	// it retries against "replication slot … is active".
	require.Eventually(t, func() bool {
		var active bool
		return e.Primary.QueryRow(ctx, "SELECT active FROM pg_replication_slots WHERE slot_name = $1", first.cfg.Slot).Scan(&active) == nil && active
	}, 10*time.Second, 10*time.Millisecond)
	runInBackground(t, ctx, second.Run)
	ids := e.writeOrders(t, ctx, 1, 10)
	pub.waitFor(t, ctx, ids)
	stopFirst()
	more := e.writeOrders(t, ctx, 100, 10)
	pub.waitFor(t, ctx, more)
}

// TestLogicalRelaySlotOfAnotherDatabase: slot names are the cluster's. A
// relay whose Slot names another database's slot gets a clear error from
// Setup instead of a START_REPLICATION that fails on every reconnect, and
// its Teardown leaves the other database's slot alone.
func TestLogicalRelaySlotOfAnotherDatabase(t *testing.T) {
	t.Parallel()
	ours, theirs := setup(t), setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	slot := uniqueSlot(theirs.Database)
	require.NoError(t, newLogical(t, theirs, LogicalConfig{Slot: slot, Publisher: newMemPublisher()}).Setup(ctx))

	r := newLogical(t, ours, LogicalConfig{Slot: slot, Publisher: newMemPublisher()})
	err := r.Setup(ctx)
	require.ErrorIs(t, err, ErrSlotInOtherDatabase)
	require.ErrorContains(t, err, theirs.Database)
	require.NoError(t, r.Teardown(ctx))
	var db string
	require.NoError(t, theirs.Primary.QueryRow(ctx, "SELECT database FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&db))
	require.Equal(t, theirs.Database, db)
}

// TestLogicalRelayTeardownRightAfterStop: the walsender outlives a
// stopped relay by a moment; one Teardown call still drops the slot.
func TestLogicalRelayTeardownRightAfterStop(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pub := newMemPublisher()
	r := newLogical(t, e, LogicalConfig{Publisher: pub})
	require.NoError(t, r.Setup(ctx))
	stop := runInBackground(t, ctx, r.Run)
	pub.waitFor(t, ctx, e.writeOrders(t, ctx, 1, 5))
	stop()
	require.NoError(t, r.Teardown(ctx))
	var n int
	require.NoError(t, e.Primary.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", r.cfg.Slot).Scan(&n))
	require.Zero(t, n)
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	pub := newMemPublisher()
	for name, tc := range map[string]struct {
		err  error
		want string
	}{
		"polling without primary":     {func() error { _, err := NewPollingRelay(PollingConfig{Publisher: pub}); return err }(), "Primary is nil"},
		"polling without publisher":   {PollingConfig{Primary: fakeDB{}}.Validate(), "Publisher is nil"},
		"polling bad database":        {PollingConfig{Primary: fakeDB{}, Publisher: pub, Database: "bad name"}.Validate(), "Database"},
		"polling bad table":           {PollingConfig{Primary: fakeDB{}, Publisher: pub, Table: "a.b.c"}.Validate(), "Table"},
		"polling negative batch":      {PollingConfig{Primary: fakeDB{}, Publisher: pub, BatchSize: -1}.Validate(), "BatchSize"},
		"polling inverted backoff":    {PollingConfig{Primary: fakeDB{}, Publisher: pub, MinBackoff: time.Second, MaxBackoff: time.Millisecond}.Validate(), "MaxBackoff"},
		"logical without conn string": {func() error { _, err := NewLogicalRelay(LogicalConfig{Publisher: pub}); return err }(), "ConnString is empty"},
		"logical bad conn string":     {LogicalConfig{Publisher: pub, ConnString: "postgres://x:notaport/y"}.Validate(), "ConnString"},
		"logical without publisher":   {LogicalConfig{ConnString: "postgres://x/y"}.Validate(), "Publisher is nil"},
		"logical bad slot":            {LogicalConfig{Publisher: pub, ConnString: "postgres://x/y", Slot: "Bad-Slot"}.Validate(), "Slot"},
		"logical bad publication":     {LogicalConfig{Publisher: pub, ConnString: "postgres://x/y", Publication: "p;"}.Validate(), "Publication"},
		"stamping both captures":      {StampingConfig{Primary: &pgxpool.Pool{}, Capture: func(context.Context) (position.Token, error) { return position.Token{}, nil }}.Validate(), "both Primary and Capture"},
		"stamping bad database":       {StampingConfig{Database: "a b"}.Validate(), "Database"},
		"stamping nil next":           {func() error { _, err := Stamping(nil, StampingConfig{}); return err }(), "next is nil"},
	} {
		require.ErrorIs(t, tc.err, ErrInvalidConfig, name)
		require.ErrorContains(t, tc.err, tc.want, name)
	}
	require.NoError(t, PollingConfig{Primary: fakeDB{}, Publisher: pub}.Validate())
	require.NoError(t, StampingConfig{}.Validate())
	// A MinBackoff above the default cap raises the cap with it.
	c := PollingConfig{MinBackoff: 10 * time.Second}.WithDefaults()
	require.Equal(t, 10*time.Second, c.MaxBackoff)

	r, err := NewLogicalRelay(LogicalConfig{Publisher: pub, ConnString: "postgres://x/y", Table: "app.My Events"})
	require.NoError(t, err)
	require.Equal(t, "caughtup_my_events", r.cfg.Slot)
	require.Equal(t, "caughtup_my_events", r.cfg.Publication)
}

func uniqueSlot(db string) string {
	h := fnv.New64a()
	h.Write([]byte(db))
	return fmt.Sprintf("co_%016x", h.Sum64())
}

type fakeDB struct{}

func (fakeDB) Begin(context.Context) (pgx.Tx, error) { return nil, context.Canceled }
