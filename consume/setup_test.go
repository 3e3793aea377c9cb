package consume

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// env is one test's database on a cluster, with a table to write to.
type env struct {
	c        *pgtest.Cluster
	db       string
	primary  *pgxpool.Pool
	replicas []*pgxpool.Pool
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func setup(t testing.TB, c *pgtest.Cluster) *env {
	t.Helper()
	ctx := ctxT(t)
	db := pgtest.NewDatabase(t, c)
	e := &env{c: c, db: db}
	var err error
	e.primary, err = c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	t.Cleanup(e.primary.Close)
	_, err = e.primary.Exec(ctx, "CREATE TABLE items (id bigserial PRIMARY KEY, v text)")
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	for _, n := range c.Replicas() {
		p, err := n.Pool(ctx, db)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		e.replicas = append(e.replicas, p)
	}
	return e
}

func (e *env) config(t testing.TB, mods ...func(*Config)) Config {
	reps := make([]replay.Replica, len(e.replicas))
	for i, p := range e.replicas {
		reps[i] = replay.Replica{Name: "r" + strconv.Itoa(i+1), Pool: p}
	}
	cfg := Config{
		Databases: map[string]replay.Database{"main": {Primary: e.primary, Replicas: reps}},
		Logger:    testLogger(t),
		Tracker:   replay.TrackerConfig{PollInterval: 50 * time.Millisecond},
	}
	for _, m := range mods {
		m(&cfg)
	}
	return cfg
}

func (e *env) router(t testing.TB, mods ...func(*Config)) *Router {
	t.Helper()
	r, err := NewRouter(ctxT(t), e.config(t, mods...))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, r.Close()) })
	return r
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// write inserts a row and returns its id with the token a producer would
// stamp: the primary's insert position read after COMMIT returned.
func (e *env) write(t testing.TB) (int64, position.Token) {
	t.Helper()
	ctx := ctxT(t)
	var id int64
	require.NoError(t, e.primary.QueryRow(ctx, "INSERT INTO items (v) VALUES ('x') RETURNING id").Scan(&id))
	return id, capture(t, e.primary, "main")
}

func capture(t testing.TB, pool *pgxpool.Pool, database string) position.Token {
	t.Helper()
	var lsnText, walfile string
	var sys int64
	require.NoError(t, pool.QueryRow(ctxT(t), `SELECT pg_current_wal_insert_lsn()::text,
		pg_walfile_name(pg_current_wal_lsn()), (SELECT system_identifier FROM pg_control_system())`).Scan(&lsnText, &walfile, &sys))
	l, err := position.ParseLSN(lsnText)
	require.NoError(t, err)
	tli, err := strconv.ParseUint(walfile[:8], 16, 32)
	require.NoError(t, err)
	return position.New(database, position.Epoch{SystemID: uint64(sys), Timeline: uint32(tli)}, l, position.SourcePrimary, time.Now())
}

func found(t testing.TB, pool *pgxpool.Pool, id int64) bool {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(ctxT(t), "SELECT count(*) FROM items WHERE id = $1", id).Scan(&n))
	return n == 1
}

func pauseAll(t testing.TB, c *pgtest.Cluster) {
	t.Helper()
	for _, n := range c.Replicas() {
		require.NoError(t, n.PauseReplay(ctxT(t)))
	}
	t.Cleanup(func() { resumeAll(t, c) })
}

func resumeAll(t testing.TB, c *pgtest.Cluster) {
	for _, n := range c.Replicas() {
		require.NoError(t, n.ResumeReplay(context.Background()))
	}
}

// seen waits until the tracker has observed every replica at or past tok.
func seen(t testing.TB, r *Router, tok position.Token) {
	t.Helper()
	e := tok.Entries[0]
	waitUntil(t, r, "every replica is seen at the token", func(s *replay.Snapshot) bool {
		ds := s.Database(e.Database)
		for _, rs := range ds.Replicas {
			if e.Compare(rs.Replayed, ds.Primary.History).Status != position.CaughtUp {
				return false
			}
		}
		return true
	})
}

// waitUntil checks cond on the router's snapshot and again on every newer
// one the tracker publishes (one per observation, so at least one per
// node and PollInterval), until it holds. cond may also look at state
// other than the snapshot that changes no later than an observation.
func waitUntil(t testing.TB, r *Router, what string, cond func(*replay.Snapshot) bool) *replay.Snapshot {
	t.Helper()
	deadline := time.NewTimer(time.Minute)
	defer deadline.Stop()
	for {
		s := r.Snapshot()
		if cond(s) {
			return s
		}
		select {
		case <-s.Changed():
		case <-deadline.C:
			t.Fatalf("gave up waiting until %s; last snapshot %+v", what, s)
		}
	}
}

// waiting is how many (job, replica) waits the tracker is polling fast
// for. A waiting job's first wait kicks its replica's poller, which then
// publishes a snapshot, so waitUntil sees the count change promptly.
func waiting(r *Router) int {
	n := 0
	for _, st := range r.Tracker().Stat() {
		n += st.Watchers
	}
	return n
}

// unitRouter is a Router over a fixed snapshot, without a tracker's
// goroutines or any connection: for what Route does around Decide. The
// snapshot's databases are configured with nil pools.
func unitRouter(t testing.TB, s *replay.Snapshot, mods ...func(*Config)) *Router {
	t.Helper()
	cfg := Config{Databases: map[string]replay.Database{}, Logger: testLogger(t), PrimaryRate: rate.Inf}
	for _, ds := range s.Databases {
		db := replay.Database{}
		for _, rs := range ds.Replicas {
			db.Replicas = append(db.Replicas, replay.Replica{Name: rs.Name})
		}
		cfg.Databases[ds.Name] = db
	}
	for _, m := range mods {
		m(&cfg)
	}
	r, err := newRouter(cfg.WithDefaults())
	require.NoError(t, err)
	mp := r.cfg.MeterProvider
	if mp == nil {
		mp = noop.NewMeterProvider()
	}
	r.met, err = newMetrics(mp, r.cfg.Databases)
	require.NoError(t, err)
	r.gate, err = newFallbackGate(&r.cfg, r.log)
	require.NoError(t, err)
	r.tr = fixed{s}
	return r
}

// fixed is a tracker whose snapshot never changes, for unit tests of the
// Router around Decide.
type fixed struct{ s *replay.Snapshot }

func (f fixed) Snapshot() *replay.Snapshot { return f.s }
func (fixed) Watch(string) func()          { return func() {} }
func (fixed) Close() error                 { return nil }

// sums is a collection's monotonic int64 sums: per instrument, per
// attribute set (encoded), the value. It fails on a series reported
// twice.
func sums(t testing.TB, reader sdkmetric.Reader) map[string]map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	out := map[string]map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			data, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				continue
			}
			pts := map[string]int64{}
			for _, dp := range data.DataPoints {
				k := dp.Attributes.Encoded(attribute.DefaultEncoder())
				_, dup := pts[k]
				require.False(t, dup, "%s{%s} reported twice", m.Name, k)
				pts[k] = dp.Value
			}
			out[m.Name] = pts
		}
	}
	return out
}

// total is the sum of an instrument's series.
func total(series map[string]int64) int64 {
	var n int64
	for _, v := range series {
		n += v
	}
	return n
}

// captured is a slog.Handler that keeps every record at Warn and above,
// for tests of what is logged.
type captured struct {
	mu      sync.Mutex
	records []slog.Record
}

func (c *captured) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

func (c *captured) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	c.records = append(c.records, r.Clone())
	c.mu.Unlock()
	return nil
}

func (c *captured) WithAttrs([]slog.Attr) slog.Handler { panic("not used") }
func (c *captured) WithGroup(string) slog.Handler      { panic("not used") }

// lines returns the records whose message starts with prefix, each as its
// attributes (groups flattened with dots).
func (c *captured) lines(prefix string) []map[string]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []map[string]string
	for _, r := range c.records {
		if !strings.HasPrefix(r.Message, prefix) {
			continue
		}
		m := map[string]string{}
		var add func(prefix string, a slog.Attr)
		add = func(prefix string, a slog.Attr) {
			if a.Value.Kind() == slog.KindGroup {
				for _, g := range a.Value.Group() {
					add(prefix+a.Key+".", g)
				}
				return
			}
			m[prefix+a.Key] = a.Value.String()
		}
		r.Attrs(func(a slog.Attr) bool { add("", a); return true })
		out = append(out, m)
	}
	return out
}

// hjob is the Job of a token carried as header text ("" for none), as an
// adapter decodes it.
func hjob(header string, p Policy) Job {
	if header == "" {
		return Job{Policy: p}
	}
	tok, err := position.DecodeHeaders(header)
	return Job{Token: tok, TokenErr: err, Policy: p}
}

// replicaStats is what the router's tracker spends on each replica of its
// first database, in order.
func replicaStats(r *Router) []replay.NodeStat {
	var out []replay.NodeStat
	stats := r.Tracker().Stat()
	for _, st := range stats {
		if st.Database == stats[0].Database && st.Replica != "" {
			out = append(out, st)
		}
	}
	return out
}

// watchers is how many callers watch replica i of the router's first
// database.
func watchers(r *Router, i int) int { return replicaStats(r)[i].Watchers }
