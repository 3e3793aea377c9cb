package caughtupasynq_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// queueName is a fresh asynq queue per test on the shared redis-server.
func queueName(t testing.TB) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return regexp.MustCompile(`[^A-Za-z0-9]+`).ReplaceAllString(t.Name(), "_") + "_" + hex.EncodeToString(b)
}

// redisEnv is a queue on the shared redis-server with a plain client, a
// stamping client and an inspector.
type redisEnv struct {
	opt       asynq.RedisClientOpt
	queue     string
	raw       *asynq.Client
	client    *caughtupasynq.Client
	inspector *asynq.Inspector
}

func setupRedis(t testing.TB) *redisEnv {
	t.Helper()
	r := pgtest.SharedRedis(t)
	e := &redisEnv{opt: asynq.RedisClientOpt{Addr: r.Addr()}, queue: queueName(t)}
	e.raw = asynq.NewClient(e.opt)
	t.Cleanup(func() { _ = e.raw.Close() })
	e.client = caughtupasynq.NewClient(e.raw)
	e.inspector = asynq.NewInspector(e.opt)
	t.Cleanup(func() { _ = e.inspector.Close() })
	return e
}

// env adds a database on the shared cluster, a router and metrics.
type env struct {
	*redisEnv
	cluster  *pgtest.Cluster
	primary  *pgxpool.Pool
	replicas []*pgxpool.Pool
	router   *consume.Router
	reader   *sdkmetric.ManualReader
	mp       *sdkmetric.MeterProvider
}

func setup(t testing.TB, mods ...func(*consume.Config)) *env {
	t.Helper()
	ctx := ctxT(t)
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	e := &env{redisEnv: setupRedis(t), cluster: c, reader: sdkmetric.NewManualReader()}
	var err error
	e.primary, err = c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	t.Cleanup(e.primary.Close)
	_, err = e.primary.Exec(ctx, `CREATE TABLE items (id bigint PRIMARY KEY, val text NOT NULL)`)
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	reps := make([]replay.Replica, 0, 2)
	for i, n := range c.Replicas() {
		p, err := n.Pool(ctx, db)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		e.replicas = append(e.replicas, p)
		reps = append(reps, replay.Replica{Name: "r" + strconv.Itoa(i+1), Pool: p})
	}
	e.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(e.reader))
	t.Cleanup(func() { _ = e.mp.Shutdown(context.Background()) })
	cfg := consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: e.primary, Replicas: reps}},
		MeterProvider: e.mp,
		Logger:        slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelError})),
		Tracker:       replay.TrackerConfig{PollInterval: 20 * time.Millisecond},
	}
	for _, m := range mods {
		m(&cfg)
	}
	e.router, err = consume.NewRouter(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.router.Close() })
	return e
}

// write inserts a row on the primary and returns ctx carrying its token.
func (e *env) write(t testing.TB, ctx context.Context, id int64) context.Context {
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

// serverConfig is a test server on the env's queue: quick to notice new
// and due tasks, quiet.
func (e *redisEnv) serverConfig(cfg asynq.Config) asynq.Config {
	cfg.Queues = map[string]int{e.queue: 1}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = 20
	}
	if cfg.DelayedTaskCheckInterval == 0 {
		cfg.DelayedTaskCheckInterval = 200 * time.Millisecond
	}
	if cfg.TaskCheckInterval == 0 {
		cfg.TaskCheckInterval = 50 * time.Millisecond
	}
	if cfg.LogLevel == 0 {
		cfg.LogLevel = asynq.ErrorLevel
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = 10 * time.Second
	}
	return cfg
}

// serve starts a server with h until the test ends (or stop is called).
func (e *redisEnv) serve(t testing.TB, cfg asynq.Config, h asynq.Handler) (stop func()) {
	t.Helper()
	srv := asynq.NewServer(e.opt, e.serverConfig(cfg))
	require.NoError(t, srv.Start(h))
	done := false
	stop = func() {
		if !done {
			done = true
			srv.Shutdown()
		}
	}
	t.Cleanup(stop)
	return stop
}

// middleware is the middleware under test, counting on the env's meter.
// Given neither Redis nor an Inspector it does not wake deferred tasks
// (WakeCapacity -1), as the tests of what it does without an Inspector
// need.
func (e *env) middleware(cfg caughtupasynq.MiddlewareConfig) asynq.MiddlewareFunc {
	cfg.MeterProvider = e.mp
	if cfg.Redis == nil && cfg.Inspector == nil && cfg.WakeCapacity == 0 {
		cfg.WakeCapacity = -1
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return caughtupasynq.Middleware(e.router, cfg)
}

// server starts a caughtupasynq.Server (the one-call wiring) on the env's
// queue with h until the test ends (or stop is called).
func (e *env) server(t testing.TB, cfg asynq.Config, mcfg caughtupasynq.MiddlewareConfig, h asynq.Handler) (stop func()) {
	t.Helper()
	mcfg.MeterProvider = e.mp
	if mcfg.Logger == nil {
		mcfg.Logger = slog.New(slog.DiscardHandler)
	}
	srv, err := caughtupasynq.NewServer(e.opt, e.serverConfig(cfg), e.router, mcfg)
	require.NoError(t, err)
	require.NoError(t, srv.Start(h))
	done := false
	stop = func() {
		if !done {
			done = true
			srv.Shutdown()
		}
	}
	t.Cleanup(stop)
	return stop
}

// pauseAll pauses replay on every replica until resume (or the test's end).
func (e *env) pauseAll(t testing.TB) (resume func()) {
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

// waitFor waits until cond holds, checking every 20ms, for state that
// announces no event of its own (a task's state in Redis, a counter).
func waitFor(t testing.TB, timeout time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	require.Eventually(t, cond, timeout, 20*time.Millisecond, append([]any{msg}, args...)...)
}

// result is what a handler chain returned for one task attempt.
type result struct {
	id      string
	retried int
	err     error
}

// observe wraps h (the middleware and the handler) and reports what it
// returned for every attempt: the event tests wait on for deferrals.
func observe(h asynq.Handler) (asynq.Handler, <-chan result) {
	ch := make(chan result, 1024)
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		err := h.ProcessTask(ctx, task)
		id, _ := asynq.GetTaskID(ctx)
		n, _ := asynq.GetRetryCount(ctx)
		ch <- result{id: id, retried: n, err: err}
		return err
	}), ch
}

// nextResult waits for the next attempt observe reports.
func nextResult(t testing.TB, ch <-chan result, timeout time.Duration) result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(timeout):
		t.Fatalf("no attempt finished within %v", timeout)
		return result{}
	}
}

// logRecords is a slog.Handler that sends every record at or above a level
// to a channel: the event tests wait on for logged errors.
type logRecords struct {
	level slog.Level
	ch    chan slog.Record
}

func newLogRecords(level slog.Level) *logRecords {
	return &logRecords{level: level, ch: make(chan slog.Record, 64)}
}

func (l *logRecords) Enabled(_ context.Context, lv slog.Level) bool { return lv >= l.level }
func (l *logRecords) Handle(_ context.Context, r slog.Record) error {
	select {
	case l.ch <- r.Clone():
	default:
	}
	return nil
}
func (l *logRecords) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecords) WithGroup(string) slog.Handler      { return l }

func (l *logRecords) next(t testing.TB, timeout time.Duration) slog.Record {
	t.Helper()
	select {
	case r := <-l.ch:
		return r
	case <-time.After(timeout):
		t.Fatalf("nothing was logged within %v", timeout)
		return slog.Record{}
	}
}
