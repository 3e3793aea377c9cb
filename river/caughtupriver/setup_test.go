package caughtupriver_test

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/river/caughtupriver"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// dbEnv is a database of its own on the shared cluster with River's schema
// and an items table, and pools on every node.
type dbEnv struct {
	cluster  *pgtest.Cluster
	primary  *pgxpool.Pool
	replicas []*pgxpool.Pool
}

func setupDB(t testing.TB) *dbEnv {
	t.Helper()
	ctx := ctxT(t)
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	e := &dbEnv{cluster: c}
	var err error
	e.primary, err = c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	t.Cleanup(e.primary.Close)
	migrate(t, e.primary)
	_, err = e.primary.Exec(ctx, `CREATE TABLE items (id bigint PRIMARY KEY, val text NOT NULL)`)
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

// migrate installs River's schema through rivermigrate.
func migrate(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	m, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	require.NoError(t, err)
	_, err = m.Migrate(ctxT(t), rivermigrate.DirectionUp, nil)
	require.NoError(t, err)
}

// env adds a router and metrics.
type env struct {
	*dbEnv
	router *consume.Router
	reader *sdkmetric.ManualReader
	mp     *sdkmetric.MeterProvider
}

func setup(t testing.TB, mods ...func(*consume.Config)) *env {
	t.Helper()
	e := &env{dbEnv: setupDB(t), reader: sdkmetric.NewManualReader()}
	e.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(e.reader))
	t.Cleanup(func() { _ = e.mp.Shutdown(context.Background()) })
	reps := make([]replay.Replica, 0, len(e.replicas))
	for i, p := range e.replicas {
		reps = append(reps, replay.Replica{Name: "r" + strconv.Itoa(i+1), Pool: p})
	}
	cfg := consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: e.primary, Replicas: reps}},
		MeterProvider: e.mp,
		Logger:        slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelError})),
		Tracker:       replay.TrackerConfig{PollInterval: 20 * time.Millisecond},
	}
	for _, m := range mods {
		m(&cfg)
	}
	var err error
	e.router, err = consume.NewRouter(ctxT(t), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.router.Close() })
	return e
}

// itemArgs names a row of items the job must read.
type itemArgs struct {
	ID int64 `json:"id"`
}

func (itemArgs) Kind() string { return "item" }

// itemWorker runs fn for each job.
type itemWorker struct {
	river.WorkerDefaults[itemArgs]
	fn func(ctx context.Context, job *river.Job[itemArgs]) error
}

func (w *itemWorker) Work(ctx context.Context, job *river.Job[itemArgs]) error {
	return w.fn(ctx, job)
}

// clientConfig is a test client's config: quick to fetch, quiet.
func clientConfig(workers int, w *itemWorker, middleware ...rivertype.Middleware) *river.Config {
	ws := river.NewWorkers()
	river.AddWorker(ws, w)
	return &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: workers}},
		Workers:           ws,
		Middleware:        middleware,
		FetchCooldown:     5 * time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
		Logger:            slog.New(slog.DiscardHandler),
	}
}

// client is a River client on the primary, stopped at cleanup. It works
// jobs when start is set.
func (e *dbEnv) client(t testing.TB, cfg *river.Config, start bool) *river.Client[pgx.Tx] {
	t.Helper()
	c, err := river.NewClient(riverpgxv5.New(e.primary), cfg)
	require.NoError(t, err)
	if start {
		require.NoError(t, c.Start(ctxT(t)))
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			require.NoError(t, c.Stop(ctx))
		})
	}
	return c
}

// middleware is the middleware under test, counting on the env's meter.
func (e *env) middleware(t testing.TB, cfg caughtupriver.Config) *caughtupriver.Middleware {
	t.Helper()
	cfg.MeterProvider = e.mp
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	mw, err := caughtupriver.NewMiddleware(e.router, cfg)
	require.NoError(t, err)
	return mw
}

// insertTx writes the row and inserts its job in one transaction, as River
// recommends: the job carries no token.
func (e *dbEnv) insertTx(t testing.TB, ctx context.Context, c *river.Client[pgx.Tx], id int64) *rivertype.JobInsertResult {
	t.Helper()
	tx, err := e.primary.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `INSERT INTO items (id, val) VALUES ($1, $2)`, id, value(id))
	require.NoError(t, err)
	res, err := c.InsertTx(ctx, tx, itemArgs{ID: id}, nil)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return res
}

// write inserts a row on the primary and returns ctx carrying its token.
func (e *dbEnv) write(t testing.TB, ctx context.Context, id int64) context.Context {
	t.Helper()
	ctx, err := enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO items (id, val) VALUES ($1, $2)`, id, value(id))
		return err
	})
	require.NoError(t, err)
	return ctx
}

func value(id int64) string { return "v" + strconv.FormatInt(id, 10) }

// read reads a row from the pool the middleware chose.
func read(ctx context.Context, id int64) (string, error) {
	pool, err := consume.Pool(ctx, "main")
	if err != nil {
		return "", fmt.Errorf("job %d: %w", id, err)
	}
	var v string
	err = pool.QueryRow(ctx, `SELECT val FROM items WHERE id = $1`, id).Scan(&v)
	return v, err
}

// pauseAll pauses replay on every replica until resume (or the test's end).
func (e *dbEnv) pauseAll(t testing.TB) (resume func()) {
	t.Helper()
	for _, n := range e.cluster.Replicas() {
		require.NoError(t, n.PauseReplay(ctxT(t)))
	}
	done := false
	resume = func() {
		if done {
			return
		}
		done = true
		for _, n := range e.cluster.Replicas() {
			require.NoError(t, n.ResumeReplay(context.Background()))
		}
	}
	t.Cleanup(resume)
	return resume
}

// sum adds up a counter's data points whose attributes include attrs.
func (e *env) sum(t testing.TB, name string, attrs map[string]string) int64 {
	t.Helper()
	want := make([]attribute.KeyValue, 0, len(attrs))
	for k, v := range attrs {
		want = append(want, attribute.String(k, v))
	}
	return metrictest.Sum(t, e.reader, name, want...)
}

// ran is what the worker saw for one run of a job.
type ran struct {
	id       int64
	attempt  int
	val      string
	err      error
	decision consume.Decision
}

// recorder is a worker that reads its row from the routed pool and
// reports every run.
func recorder() (*itemWorker, <-chan ran) {
	ch := make(chan ran, 4096)
	return &itemWorker{fn: func(ctx context.Context, job *river.Job[itemArgs]) error {
		v, err := read(ctx, job.Args.ID)
		d, _ := consume.DecisionFrom(ctx)
		ch <- ran{id: job.Args.ID, attempt: job.Attempt, val: v, err: err, decision: d}
		return err
	}}, ch
}

func next(t testing.TB, ch <-chan ran, timeout time.Duration) ran {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(timeout):
		t.Fatalf("no job ran within %v", timeout)
		return ran{}
	}
}
