package caughtupkgo_test

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
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
		Logger:        testLogger(t),
	}
	if tweak != nil {
		tweak(&rc)
	}
	e.router, err = consume.NewRouter(ctx, rc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.router.Close() })
	return e
}

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

// insert writes the row of record (key, seq) and returns ctx carrying
// its token.
func (e *env) insert(ctx context.Context, id int64, key string, seq int) (context.Context, error) {
	return enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO items (id, key, seq) VALUES ($1, $2, $3)`, id, key, seq)
		return err
	})
}

// farAhead is a token naming a position no replica will reach for a long
// time, on the cluster's real epoch.
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

// sums sums counter name by attribute attr.
func (e *env) sums(t testing.TB, name, attr string) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, e.metrics.Collect(context.Background(), &rm))
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

// testLogger sends warnings and errors to the test log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(logWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type logWriter struct{ t testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}

// testConfig fills in what every test consumer uses: quick fetches,
// commits and rebalances. The caller gives the Router.
func testConfig(t testing.TB, cfg caughtupkgo.ConsumerConfig) caughtupkgo.ConsumerConfig {
	if cfg.ClientOpts == nil {
		cfg.ClientOpts = []kgo.Opt{kgo.SeedBrokers(brokers(t)...)}
	}
	cfg.ClientOpts = append([]kgo.Opt{
		kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.HeartbeatInterval(200 * time.Millisecond),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	}, cfg.ClientOpts...)
	if cfg.GroupID == "" {
		cfg.GroupID = newGroup(t)
	}
	if cfg.CommitInterval == 0 {
		cfg.CommitInterval = 100 * time.Millisecond
	}
	if cfg.RetryBackoffInitial == 0 {
		cfg.RetryBackoffInitial = 20 * time.Millisecond
		cfg.RetryBackoffMax = 100 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	return cfg
}

// running is a consumer started by startConsumer.
type running struct {
	c      *caughtupkgo.Consumer
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

// startConsumer runs a consumer until stop or the end of the test.
func startConsumer(t testing.TB, cfg caughtupkgo.ConsumerConfig, h caughtupkgo.Handler) *running {
	t.Helper()
	c, err := caughtupkgo.NewConsumer(testConfig(t, cfg), h)
	require.NoError(t, err)
	r := &running{c: c, done: make(chan error, 1)}
	var ctx context.Context
	ctx, r.cancel = context.WithCancel(context.Background())
	go func() { r.done <- c.Run(ctx) }()
	t.Cleanup(func() { require.NoError(t, r.stop()) })
	return r
}

// stop cancels the consumer and waits for Run to return.
func (r *running) stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(30 * time.Second):
			r.err = fmt.Errorf("the consumer did not stop within 30s")
		}
	})
	return r.err
}

// payload is a test record's value: "id,key,seq".
func payload(id int64, key string, seq int) []byte {
	return []byte(fmt.Sprintf("%d,%s,%d", id, key, seq))
}

func parsePayload(v []byte) (id int64, key string, seq int, err error) {
	parts := strings.Split(string(v), ",")
	if len(parts) != 3 {
		return 0, "", 0, fmt.Errorf("payload %q", v)
	}
	if id, err = strconv.ParseInt(parts[0], 10, 64); err != nil {
		return 0, "", 0, err
	}
	seq, err = strconv.Atoi(parts[2])
	return id, parts[1], seq, err
}

// ledger checks what handlers saw: every record's row read fresh from the
// pool the router chose, per-key order under at-least-once, and how often
// each record ran.
type ledger struct {
	mu         sync.Mutex
	runs       map[int64]int
	next       map[string]int
	stale      []string
	violations []string
	outcomes   map[consume.Outcome]int
	partitions map[int64]int32 // record id -> partition it ran from
	distinct   int
	changed    chan struct{}
}

func newLedger() *ledger {
	return &ledger{runs: map[int64]int{}, next: map[string]int{}, outcomes: map[consume.Outcome]int{},
		partitions: map[int64]int32{}, changed: make(chan struct{}, 1)}
}

// handle is a consumer handler: it reads the record's row where the
// router sent it and records the run.
func (l *ledger) handle(ctx context.Context, r *kgo.Record) error {
	id, key, seq, err := parsePayload(r.Value)
	if err != nil {
		return err
	}
	var stale string
	if pool, err := consume.Pool(ctx, "main"); err != nil {
		stale = fmt.Sprintf("record %d: no pool in the handler's context: %v", id, err)
	} else {
		var gotKey string
		var gotSeq int
		err := pool.QueryRow(ctx, `SELECT key, seq FROM items WHERE id = $1`, id).Scan(&gotKey, &gotSeq)
		switch {
		case err == pgx.ErrNoRows:
			dec, _ := consume.DecisionFrom(ctx)
			stale = fmt.Sprintf("record %d: row not found (outcome %s)", id, dec.Outcome)
		case err != nil:
			return err
		case gotKey != key || gotSeq != seq:
			stale = fmt.Sprintf("record %d: read (%s,%d), want (%s,%d)", id, gotKey, gotSeq, key, seq)
		}
	}
	dec, routed := consume.DecisionFrom(ctx)
	l.mu.Lock()
	defer l.mu.Unlock()
	if stale != "" {
		l.stale = append(l.stale, stale)
	}
	switch n := l.next[key]; {
	case seq == n:
		l.next[key] = n + 1
	case seq > n:
		l.violations = append(l.violations, fmt.Sprintf("key %s: record %d handled before record %d", key, seq, n))
	}
	l.runs[id]++
	if l.runs[id] == 1 {
		l.distinct++
	}
	l.partitions[id] = r.Partition
	if routed {
		l.outcomes[dec.Outcome]++
	}
	select {
	case l.changed <- struct{}{}:
	default:
	}
	return nil
}

func (l *ledger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.distinct
}

// waitDistinct waits until n distinct records ran.
func (l *ledger) waitDistinct(t testing.TB, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		if d := l.count(); d >= n {
			return
		}
		select {
		case <-l.changed:
		case <-deadline:
			t.Fatalf("only %d of %d records ran within %v", l.count(), n, timeout)
		}
	}
}

// summary returns stale reads, lost records, order violations and
// duplicate runs for ids 1..n.
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
