package caughtupkafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/cdc"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The tests in this file consume real Debezium change events: the Debezium
// PostgreSQL connector (pgoutput) on the test binary's Kafka Connect
// worker reads the test's database on the shared primary and writes to
// the shared broker; the consumer routes them with TokenFormat
// TokenDebezium. They pause replay on the shared replicas, so none runs in
// parallel.

// debezium starts a connector on e's database capturing tables (created
// already), whose topics get partitions partitions (created before the
// connector, which would otherwise create them with the broker's default
// of one). It returns the topic of each table, in order.
func debezium(t *testing.T, e *env, partitions int, tables ...string) []string {
	t.Helper()
	prefix := kafkatest.Name(t)
	topics := make([]string, len(tables))
	qualified := make([]string, len(tables))
	b := kafkatest.Shared(t)
	for i, table := range tables {
		qualified[i] = "public." + table
		topics[i] = prefix + ".public." + table
		require.NoError(t, b.CreateTopic(t.Context(), topics[i], partitions))
	}
	src, err := kafkatest.PostgresFromDSN(e.Cluster.Primary().DSN(e.DB))
	require.NoError(t, err)
	kafkatest.NewPostgresConnector(t, kafkatest.SharedConnect(t), kafkatest.DebeziumPostgres{
		Postgres: src, Tables: qualified, TopicPrefix: prefix,
	})
	return topics
}

// change is what a handler needs from a Debezium event.
type change struct {
	Op     string          `json:"op"`
	After  json.RawMessage `json:"after"`
	Source struct {
		TxID int64 `json:"txId"`
		LSN  int64 `json:"lsn"`
	} `json:"source"`
}

// parseChange reads a change event in a handler (not the test's
// goroutine: it reports, it does not stop).
func parseChange(t testing.TB, v []byte, after any) (change, bool) {
	var c change
	err := json.Unmarshal(v, &c)
	if err == nil {
		err = json.Unmarshal(c.After, after)
	}
	if err != nil {
		t.Errorf("not a change event (%v): %s", err, v)
		return c, false
	}
	return c, true
}

// cdcRouter: quick waits and deferrals, and a MaxAge far beyond the
// tests, so that no event reads the primary for age.
func cdcRouter(c *consume.Config) {
	kafkasuite.FastRouter(c)
	c.MaxAge = 10 * time.Minute
}

// TestDebeziumNeverFreshBeforeCommit: a transaction inserts a row, every
// replica replays the insert and is then paused before the commit, and
// the transaction commits. Debezium's event for the row carries
// source.lsn, which every replica has passed: replay >= source.lsn alone
// would read a replica that does not show the row. The consumer never
// runs it on a replica while replay is paused (the checker finds the
// transaction in progress there, again at every deferral step), and once
// replay resumes it runs on a replica that shows the row, within a
// generous bound.
func TestDebeziumNeverFreshBeforeCommit(t *testing.T) {
	e := setupDB(t, cdcRouter)
	ctx := t.Context()
	_, err := e.Primary.Exec(ctx, `CREATE TABLE orders (id bigint PRIMARY KEY, item text NOT NULL)`)
	require.NoError(t, err)
	topic := debezium(t, e, 1, "orders")[0]

	type run struct {
		dec     consume.Decision
		visible bool
		op      string
	}
	runs := make(chan run, 16)
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, TokenFormat: caughtupkafka.TokenDebezium, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
	}, func(ctx context.Context, msg kafka.Message) error {
		var after struct {
			ID int64 `json:"id"`
		}
		c, ok := parseChange(t, msg.Value, &after)
		if !ok {
			return nil
		}
		var n int
		if err := consume.DB(ctx, "main").QueryRow(ctx, `SELECT count(*) FROM orders WHERE id = $1`, after.ID).Scan(&n); err != nil {
			return err
		}
		dec, _ := consume.DecisionFrom(ctx)
		runs <- run{dec: dec, visible: n == 1, op: c.Op}
		return nil
	})

	// The transaction: insert, replicas past the insert, pause, commit.
	conn, err := e.Primary.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	var insertText string
	require.NoError(t, tx.QueryRow(ctx, `WITH i AS (INSERT INTO orders VALUES (1, 'apple') RETURNING 1)
		SELECT pg_current_wal_insert_lsn()::text FROM i`).Scan(&insertText))
	flush := func() {
		// A commit record flushes the WAL before it, the open insert's too.
		_, err := e.Primary.Exec(ctx, `SELECT pg_current_xact_id()`)
		require.NoError(t, err)
	}
	flush()
	for _, n := range e.Cluster.Replicas() {
		require.NoError(t, n.WaitReplay(ctx, insertText))
	}
	for i, n := range e.Cluster.Replicas() {
		// A pause takes effect at the next record replayed: make one.
		require.NoError(t, pgtest.RequestReplayPause(ctx, e.Replicas[i]))
		flush()
		require.NoError(t, n.PauseReplay(ctx))
	}
	t.Cleanup(func() { e.ResumeAll(t) })
	require.NoError(t, tx.Commit(ctx))

	// The real envelope: source.lsn is below every replica's replay.
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: kafkasuite.Brokers(t), Topic: topic, Partition: 0, MaxWait: 100 * time.Millisecond})
	defer func() { require.NoError(t, rd.Close()) }()
	rctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	msg, err := rd.ReadMessage(rctx)
	require.NoError(t, err, "Debezium's event for the transaction")
	ev, err := cdc.ParseDebezium(msg.Value)
	require.NoError(t, err)
	require.NoError(t, ev.Validate(), "a streamed insert: %s", msg.Value)
	t.Logf("envelope source: lsn %s txId %d", ev.Source.LSN, ev.Source.TxID)
	checker, err := cdc.NewChecker(cdc.Config{})
	require.NoError(t, err)
	for i, n := range e.Cluster.Replicas() {
		replay, err := n.ReplayLSN(ctx)
		require.NoError(t, err)
		require.GreaterOrEqual(t, position.MustParseLSN(replay), ev.Source.LSN, "replica %s has replayed the change", n.Name())
		res := checker.Check(ctx, e.Replicas[i], ev.Source)
		require.Equal(t, cdc.StatusNotYet, res.Status, "replica %s: %+v", n.Name(), res)
		require.Equal(t, cdc.ReasonInProgress, res.Reason)
	}

	// The consumer keeps finding the transaction in progress and waits in
	// place; the handler does not run.
	require.Eventually(t, func() bool {
		checks := e.Sums(t, "caughtup.cdc.checks", "caughtup.reason")
		return checks["in_progress"] >= 3 && e.Results(t)["waited"] >= 3
	}, time.Minute, 10*time.Millisecond, "the consumer never checked the event on a replica")
	select {
	case r := <-runs:
		t.Fatalf("the event ran while no replica had replayed its commit: %+v", r)
	default:
	}

	// After resume: fresh, on a replica that shows the row.
	e.ResumeAll(t)
	r := wait(t, runs, "the event's run after replay resumed")
	require.Equal(t, "c", r.op)
	require.Contains(t, []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited}, r.dec.Outcome, "%+v", r.dec)
	require.True(t, r.visible, "the replica chosen does not show the row")
	t.Logf("cdc checks %v; consumer results %v; outcomes %v",
		e.Sums(t, "caughtup.cdc.checks", "caughtup.reason"), e.Results(t), e.Outcomes(t))
}

// TestDebeziumTopicFreshAndOrderedUnderPausedReplay: transactions update
// per-key counters (some two keys at once) while replay pauses at random
// on one or both replicas; the Debezium topic of the table, 4 partitions
// keyed by the row's key, is consumed through the adapter. Every change
// runs, every read shows at least the change's value, and every key's
// changes run in order. The rows present before the connector started
// come as snapshot reads and read the primary.
func TestDebeziumTopicFreshAndOrderedUnderPausedReplay(t *testing.T) {
	e := setupDB(t, cdcRouter)
	ctx := t.Context()
	const keys = 16
	txns := min(messageCount(t)/5, 2000)
	_, err := e.Primary.Exec(ctx, `CREATE TABLE counters (key text PRIMARY KEY, seq int NOT NULL)`)
	require.NoError(t, err)
	for k := range keys {
		_, err := e.Primary.Exec(ctx, `INSERT INTO counters VALUES ($1, 0)`, "k"+strconv.Itoa(k))
		require.NoError(t, err)
	}
	topic := debezium(t, e, 4, "counters")[0]

	var mu sync.Mutex
	next := map[string]int{} // per key: the next seq expected
	var stale, violations []string
	runs, snapshots := 0, 0
	done := make(chan struct{}, 1)
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, TokenFormat: caughtupkafka.TokenDebezium, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
	}, func(ctx context.Context, msg kafka.Message) error {
		var row struct {
			Key string `json:"key"`
			Seq int    `json:"seq"`
		}
		c, ok := parseChange(t, msg.Value, &row)
		if !ok {
			return nil
		}
		var got int
		err := consume.DB(ctx, "main").QueryRow(ctx, `SELECT seq FROM counters WHERE key = $1`, row.Key).Scan(&got)
		if err != nil {
			return err
		}
		dec, _ := consume.DecisionFrom(ctx)
		mu.Lock()
		defer mu.Unlock()
		runs++
		if got < row.Seq {
			stale = append(stale, fmt.Sprintf("%s=%d read %d (%s)", row.Key, row.Seq, got, dec.Outcome))
		}
		if c.Op == "r" {
			snapshots++
			if dec.Outcome != consume.OutcomePrimaryNoToken {
				violations = append(violations, fmt.Sprintf("snapshot read of %s routed %s", row.Key, dec.Outcome))
			}
			return nil
		}
		switch n := next[row.Key]; {
		case row.Seq == n+1:
			next[row.Key] = row.Seq
		case row.Seq > n+1:
			violations = append(violations, fmt.Sprintf("key %s: change %d ran before change %d", row.Key, row.Seq, n+1))
		}
		select {
		case done <- struct{}{}:
		default:
		}
		return nil
	})

	// Replay pauses from before the first change until the last one ran.
	pctx, stopPauses := context.WithCancel(ctx)
	paused := make(chan struct{})
	go func() { defer close(paused); e.Cluster.PauseRandomly(pctx, time.Second, 300*time.Millisecond, t.Logf) }()
	defer func() { stopPauses(); <-paused }()
	start := time.Now()
	final := produceCounters(t, e, keys, txns, 8, 250)
	produced := time.Since(start)

	// Wait until every key's last change ran.
	deadline := time.After(3 * time.Minute)
	for {
		mu.Lock()
		missing := 0
		for k, last := range final {
			if next[k] < last {
				missing += last - next[k]
			}
		}
		mu.Unlock()
		if missing == 0 {
			break
		}
		select {
		case <-done:
		case <-deadline:
			t.Fatalf("%d changes never ran", missing)
		}
	}
	stopPauses()
	<-paused
	mu.Lock()
	defer mu.Unlock()
	changes := 0
	for _, last := range final {
		changes += last
	}
	t.Logf("transactions=%d changes=%d runs=%d snapshot_reads=%d stale=%d order_violations=%d produced_in=%v total=%v",
		txns, changes, runs, snapshots, len(stale), len(violations), produced.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	t.Logf("router outcomes %v; consumer results %v; cdc checks %v", e.Outcomes(t), e.Results(t),
		e.Sums(t, "caughtup.cdc.checks", "caughtup.reason"))
	require.Empty(t, stale, "stale reads")
	require.Empty(t, violations, "per-key order, snapshot reads on the primary")
	require.Equal(t, keys, snapshots, "one snapshot read per row present at the start")
	// Every change ran (the loop above), each key in order: none lost.
}

// produceCounters runs txns transactions on producers goroutines, at most
// perSecond of them a second (so that they span several replay pauses),
// each adding 1 to one key's counter, or every tenth to two keys' at once,
// and returns every key's final value.
func produceCounters(t *testing.T, e *env, keys, txns, producers int, perSecond rate.Limit) map[string]int {
	t.Helper()
	ctx := t.Context()
	lim := rate.NewLimiter(perSecond, producers)
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for p := range producers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(p), 99))
			for i := p; i < txns; i += producers {
				a, b := rng.IntN(keys), rng.IntN(keys)
				ks := []string{"k" + strconv.Itoa(min(a, b))}
				if i%10 == 0 && a != b {
					ks = append(ks, "k"+strconv.Itoa(max(a, b))) // in key order: no deadlock
				}
				if err := lim.Wait(ctx); err != nil {
					errs <- err
					return
				}
				err := pgx.BeginFunc(ctx, e.Primary, func(tx pgx.Tx) error {
					for _, k := range ks {
						if _, err := tx.Exec(ctx, `UPDATE counters SET seq = seq + 1 WHERE key = $1`, k); err != nil {
							return err
						}
					}
					return nil
				})
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	final := map[string]int{}
	rows, err := e.Primary.Query(ctx, `SELECT key, seq FROM counters`)
	require.NoError(t, err)
	for rows.Next() {
		var k string
		var s int
		require.NoError(t, rows.Scan(&k, &s))
		final[k] = s
	}
	require.NoError(t, rows.Err())
	return final
}

// TestDebeziumUnvouchedReadsPrimary: what the commit-safe rule cannot
// vouch for reads the primary and is counted, on a Debezium-mode
// consumer: a tombstone and a snapshot read (no token), an envelope that
// is not JSON, one from another connector and one without txId
// (malformed), and a well-formed event whose transaction rolled back, so
// that the replica answers "aborted" although it replayed the change
// (unverified). Hand-written envelopes, on a topic of their own.
func TestDebeziumUnvouchedReadsPrimary(t *testing.T) {
	t.Parallel()
	e := setupDB(t, func(c *consume.Config) {
		cdcRouter(c)
		c.Logger = kafkasuite.Logger(t) // the warnings this test provokes
	})
	ctx := t.Context()
	topic := kafkasuite.NewTopics(t, 1, "")[0]

	// A rolled-back insert: its change is in the WAL, its xid aborted.
	tx, err := e.Primary.Begin(ctx)
	require.NoError(t, err)
	var xid uint64
	var lsnText string
	require.NoError(t, tx.QueryRow(ctx, `WITH i AS (INSERT INTO items VALUES (1, 'k', 0) RETURNING 1)
		SELECT pg_current_xact_id()::text::bigint, pg_current_wal_insert_lsn()::text FROM i`).Scan(&xid, &lsnText))
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, e.Cluster.WaitReplicasCaughtUp(ctx))
	aborted := fmt.Sprintf(`{"op":"c","after":{"id":1},"source":{"connector":"postgresql","snapshot":"false","txId":%d,"lsn":%d,"ts_ms":%d}}`,
		xid&0xFFFFFFFF, uint64(position.MustParseLSN(lsnText)), time.Now().UnixMilli())

	cases := []struct {
		name, value string
		outcome     consume.Outcome
		reason      consume.Reason
	}{
		{"tombstone", "", consume.OutcomePrimaryNoToken, consume.ReasonNoToken},
		{"snapshot", `{"op":"r","after":{"id":1},"source":{"connector":"postgresql","snapshot":"true","txId":5,"lsn":100}}`, consume.OutcomePrimaryNoToken, consume.ReasonNoToken},
		{"not json", `not json`, consume.OutcomePrimaryNoToken, consume.ReasonMalformedToken},
		{"mysql", `{"op":"c","source":{"connector":"mysql","pos":154}}`, consume.OutcomePrimaryNoToken, consume.ReasonMalformedToken},
		{"no txId", `{"op":"c","source":{"connector":"postgresql","lsn":100}}`, consume.OutcomePrimaryNoToken, consume.ReasonMalformedToken},
		{"aborted", aborted, consume.OutcomePrimary, consume.ReasonUnverified},
	}
	type run struct {
		dec     consume.Decision
		primary bool
	}
	got := make(chan run, len(cases))
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, TokenFormat: caughtupkafka.TokenDebezium, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
	}, func(ctx context.Context, msg kafka.Message) error {
		dec, _ := consume.DecisionFrom(ctx)
		got <- run{dec, consume.DB(ctx, "main") == e.Primary}
		return nil
	})
	w := newWriter(t, topic)
	for _, tc := range cases {
		m := kafka.Message{Key: []byte(tc.name)}
		if tc.value != "" {
			m.Value = []byte(tc.value)
		}
		require.NoError(t, w.WriteMessages(ctx, m))
	}
	for _, tc := range cases {
		r := wait(t, got, tc.name)
		require.Equal(t, tc.outcome, r.dec.Outcome, tc.name)
		require.Equal(t, tc.reason, r.dec.Reason, tc.name)
		require.True(t, r.primary, "%s read elsewhere than the primary", tc.name)
	}
	primary := e.Sums(t, "caughtup.cdc.primary", "caughtup.reason")
	require.Equal(t, map[string]int64{"snapshot": 1, "malformed": 1, "not_postgresql": 1, "missing_txid": 1, "aborted": 1}, primary)
}

// TestDebeziumConfig: the database defaults to the router's only one, must
// be named when the router has several, and must be one of them.
func TestDebeziumConfig(t *testing.T) {
	t.Parallel()
	e := setupDB(t, nil)
	h := func(context.Context, kafka.Message) error { return nil }
	base := caughtupkafka.ConsumerConfig{Brokers: []string{"localhost:9092"}, GroupID: "g", Topic: "t",
		Router: e.Router, TokenFormat: caughtupkafka.TokenDebezium}
	c, err := caughtupkafka.NewConsumer(base, h)
	require.NoError(t, err)
	require.Equal(t, "main", c.Config().Debezium.Database, "the router's only database")

	bad := base
	bad.Debezium.Database = "billing"
	_, err = caughtupkafka.NewConsumer(bad, h)
	require.ErrorIs(t, err, caughtupkafka.ErrInvalidConfig)
	require.ErrorContains(t, err, `"billing"`)

	bad = base
	bad.TokenFormat = 7
	_, err = caughtupkafka.NewConsumer(bad, h)
	require.ErrorIs(t, err, caughtupkafka.ErrInvalidConfig)

	rc := e.Router.Config()
	rc.Databases["other"] = rc.Databases["main"]
	two, err := consume.NewRouter(t.Context(), rc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = two.Close() })
	bad = base
	bad.Router = two
	_, err = caughtupkafka.NewConsumer(bad, h)
	require.ErrorIs(t, err, caughtupkafka.ErrInvalidConfig, "several databases: name one")
	bad.Debezium.Database = "other"
	_, err = caughtupkafka.NewConsumer(bad, h)
	require.NoError(t, err)
	require.Equal(t, "debezium", caughtupkafka.TokenDebezium.String())
}

// TestDebeziumUnknownEpochReadsPrimary: while the router has no recent
// observation of its primary it knows no epoch to give an envelope, and a
// change event reads the primary (primary_epoch) instead of being compared
// with the replicas on a guess.
func TestDebeziumUnknownEpochReadsPrimary(t *testing.T) {
	t.Parallel()
	e := setupDB(t, nil)
	dead, err := pgxpool.New(t.Context(), "postgres://postgres@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(dead.Close)
	router, err := consume.NewRouter(t.Context(), consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: dead, Replicas: replay.Replicas(e.Replicas...)}},
		Logger:    kafkasuite.Logger(t),
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = router.Close() })

	topic := kafkasuite.NewTopics(t, 1, "")[0]
	got := make(chan consume.Decision, 1)
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, TokenFormat: caughtupkafka.TokenDebezium, Router: router, Policy: consume.Delayed,
	}, func(ctx context.Context, msg kafka.Message) error {
		dec, _ := consume.DecisionFrom(ctx)
		got <- dec
		return nil
	})
	// A position every replica has passed, and a transaction ID.
	value := fmt.Sprintf(`{"op":"c","after":{"id":1},"source":{"connector":"postgresql","snapshot":"false","txId":700,"lsn":%d,"ts_ms":%d}}`,
		uint64(position.MustParseLSN("0/100")), time.Now().UnixMilli())
	require.NoError(t, newWriter(t, topic).WriteMessages(t.Context(), kafka.Message{Value: []byte(value)}))
	dec := wait(t, got, "the event's run")
	require.Equal(t, consume.OutcomePrimaryEpoch, dec.Outcome)
	require.Equal(t, consume.ReasonEpoch, dec.Reason)
	dd, ok := dec.Database("main")
	require.True(t, ok)
	require.Equal(t, position.UnknownEpoch, dd.Incomparable)
}
