package caughtupkafka_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// env is one test's database on the shared cluster (table items, on every
// replica), its pools and a router over them.
type env struct {
	c        *pgtest.Cluster
	db       string
	primary  *pgxpool.Pool
	replicas []*pgxpool.Pool
	router   *consume.Router
	metrics  *sdkmetric.ManualReader
	mp       *sdkmetric.MeterProvider
}

// fastRouter shortens the router's waits so that deferrals show up within
// a test's time: a 200ms wait budget, then deferrals from 50ms to 250ms.
func fastRouter(c *consume.Config) {
	c.WaitBudget = 200 * time.Millisecond
	c.DeferInitial = 50 * time.Millisecond
	c.DeferMax = 250 * time.Millisecond
}

func setupDB(t testing.TB, tweak func(*consume.Config)) *env {
	t.Helper()
	ctx := t.Context()
	c := pgtest.Shared(t)
	e := &env{c: c, db: pgtest.NewDatabase(t, c), metrics: sdkmetric.NewManualReader()}
	e.primary = e.pool(t, c.Primary())
	_, err := e.primary.Exec(ctx, `CREATE TABLE items (id bigint PRIMARY KEY, key text NOT NULL, seq int NOT NULL)`)
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	for _, n := range c.Replicas() {
		e.replicas = append(e.replicas, e.pool(t, n))
	}
	e.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(e.metrics))
	t.Cleanup(func() { _ = e.mp.Shutdown(context.Background()) })
	rc := consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: e.primary, Replicas: replay.Replicas(e.replicas...)}},
		MeterProvider: e.mp,
	}
	if tweak != nil {
		tweak(&rc)
	}
	e.router, err = consume.NewRouter(ctx, rc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.router.Close() })
	return e
}

// pool opens a pool on n with room for the tests' producer goroutines;
// closed before the database is dropped.
func (e *env) pool(t testing.TB, n *pgtest.Node) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(n.DSN(e.db))
	require.NoError(t, err)
	cfg.MaxConns = 24
	p, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

// insert writes the row of message (key, seq) and returns ctx carrying
// its token.
func (e *env) insert(ctx context.Context, id int64, key string, seq int) (context.Context, error) {
	return enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO items (id, key, seq) VALUES ($1, $2, $3)`, id, key, seq)
		return err
	})
}

// farAhead is a token naming a position no replica will reach for a long
// time, on the cluster's real epoch: messages carrying it wait (then read
// the primary after MaxAge).
func (e *env) farAhead(t testing.TB) position.Token {
	t.Helper()
	ctx := t.Context()
	sys, err := e.c.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)
	tli, err := e.c.Primary().Timeline(ctx)
	require.NoError(t, err)
	cur, err := e.c.Primary().ReplayLSN(ctx)
	require.NoError(t, err)
	lsn := position.MustParseLSN(cur) + 1<<40
	return position.New("main", position.Epoch{SystemID: sys, Timeline: tli}, lsn, position.SourcePrimary, time.Now())
}

// outcomes sums the router's decisions counter by outcome.
func (e *env) outcomes(t testing.TB) map[string]int64 {
	return sumCounter(t, e.metrics, "caughtup.consume.decisions", "caughtup.outcome")
}

// results sums caughtup.kafka.messages by result.
func (e *env) results(t testing.TB) map[string]int64 {
	return sumCounter(t, e.metrics, "caughtup.kafka.messages", "caughtup.kafka.result")
}

func sumCounter(t testing.TB, r *sdkmetric.ManualReader, name, attr string) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, r.Collect(context.Background(), &rm))
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				continue
			}
			for _, dp := range sum.DataPoints {
				v, _ := dp.Attributes.Value(attribute.Key(attr))
				out[v.AsString()] += dp.Value
			}
		}
	}
	return out
}

// pauseRandomly pauses replay on one or both replicas for random spells of
// up to maxPause until ctx ends, and leaves every replica resumed.
func pauseRandomly(ctx context.Context, t *testing.T, replicas []*pgtest.Node, maxPause time.Duration) {
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	bg := context.Background()
	for ctx.Err() == nil {
		paused := replicas
		if rng.IntN(3) != 0 {
			paused = []*pgtest.Node{replicas[rng.IntN(len(replicas))]}
		}
		for _, n := range paused {
			if err := n.PauseReplay(bg); err != nil {
				t.Errorf("pause %s: %v", n.Name(), err)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(int64(maxPause) + 1))):
		}
		for _, n := range paused {
			if err := n.ResumeReplay(bg); err != nil {
				t.Errorf("resume %s: %v", n.Name(), err)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(rng.Int64N(int64(300 * time.Millisecond)))):
		}
	}
}

// pauseAll pauses replay on every replica until resumed or cleanup.
func (e *env) pauseAll(t *testing.T) {
	t.Helper()
	for _, n := range e.c.Replicas() {
		require.NoError(t, n.PauseReplay(t.Context()))
	}
	t.Cleanup(func() { e.resumeAll(t) })
}

func (e *env) resumeAll(t *testing.T) {
	for _, n := range e.c.Replicas() {
		if err := n.ResumeReplay(context.Background()); err != nil {
			t.Errorf("resume %s: %v", n.Name(), err)
		}
	}
}

// payload is a test message's value: "id,key,seq".
func payload(id int64, key string, seq int) []byte {
	return []byte(fmt.Sprintf("%d,%s,%d", id, key, seq))
}

func parsePayload(t testing.TB, v []byte) (id int64, key string, seq int) {
	parts := strings.Split(string(v), ",")
	require.Len(t, parts, 3, "payload %q", v)
	id, err := strconv.ParseInt(parts[0], 10, 64)
	require.NoError(t, err)
	seq, err = strconv.Atoi(parts[2])
	require.NoError(t, err)
	return id, parts[1], seq
}

// ledger checks what handlers saw: every message's row read fresh from the
// pool the router chose, per-key order under at-least-once (the n-th
// message of a key is first handled only after messages 0..n-1 of that key
// were), and how often each message ran.
type ledger struct {
	t          testing.TB
	mu         sync.Mutex
	runs       map[int64]int
	next       map[string]int // per key: how many leading messages were handled
	stale      []string
	violations []string
	outcomes   map[consume.Outcome]int
	distinct   int
	changed    chan struct{}
}

func newLedger(t testing.TB) *ledger {
	return &ledger{t: t, runs: map[int64]int{}, next: map[string]int{}, outcomes: map[consume.Outcome]int{}, changed: make(chan struct{}, 1)}
}

// handle is a consumer handler: it reads the message's row where the
// router sent it and records the run.
func (l *ledger) handle(ctx context.Context, msg kafka.Message) error {
	id, key, seq := parsePayload(l.t, msg.Value)
	var stale string
	if pool, err := consume.Pool(ctx, "main"); err != nil {
		stale = fmt.Sprintf("message %d: no pool in the handler's context: %v", id, err)
	} else {
		var gotKey string
		var gotSeq int
		err := pool.QueryRow(ctx, `SELECT key, seq FROM items WHERE id = $1`, id).Scan(&gotKey, &gotSeq)
		switch {
		case err == pgx.ErrNoRows:
			dec, _ := consume.DecisionFrom(ctx)
			stale = fmt.Sprintf("message %d: row not found (outcome %s)", id, dec.Outcome)
		case err != nil:
			return err
		case gotKey != key || gotSeq != seq:
			stale = fmt.Sprintf("message %d: read (%s,%d), want (%s,%d)", id, gotKey, gotSeq, key, seq)
		}
	}
	dec, routed := consume.DecisionFrom(ctx)
	l.record(id, key, seq, dec.Outcome, routed, stale)
	return nil
}

func (l *ledger) record(id int64, key string, seq int, outcome consume.Outcome, routed bool, stale string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if stale != "" {
		l.stale = append(l.stale, stale)
	}
	switch n := l.next[key]; {
	case seq == n:
		l.next[key] = n + 1
	case seq > n:
		l.violations = append(l.violations, fmt.Sprintf("key %s: message %d handled before message %d", key, seq, n))
	}
	l.runs[id]++
	if l.runs[id] == 1 {
		l.distinct++
	}
	if routed {
		l.outcomes[outcome]++
	}
	select {
	case l.changed <- struct{}{}:
	default:
	}
}

// waitDistinct waits until n distinct messages ran.
func (l *ledger) waitDistinct(t testing.TB, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		l.mu.Lock()
		d := l.distinct
		l.mu.Unlock()
		if d >= n {
			return
		}
		// record leaves a signal in changed's one-slot buffer after
		// every run, so a run between the check and here is not missed.
		select {
		case <-l.changed:
		case <-deadline:
			t.Fatalf("only %d of %d messages ran within %v", d, n, timeout)
		}
	}
}

// summary returns messages, stale reads, lost messages, order violations
// and duplicate runs for ids 1..n.
func (l *ledger) summary(n int) (stale, lost, violations, dups int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for id := int64(1); id <= int64(n); id++ {
		switch r := l.runs[id]; {
		case r == 0:
			lost++
		case r > 1:
			dups += r - 1
		}
	}
	return len(l.stale), lost, len(l.violations), dups
}

// keyFor returns a key that the Hash balancer sends to partition p of n.
func keyFor(p, n int, prefix string) string {
	parts := make([]int, n)
	for i := range parts {
		parts[i] = i
	}
	h := &kafka.Hash{}
	for i := 0; ; i++ {
		k := fmt.Sprintf("%s%d", prefix, i)
		if h.Balance(kafka.Message{Key: []byte(k)}, parts...) == p {
			return k
		}
	}
}
