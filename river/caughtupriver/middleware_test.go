package caughtupriver_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/river/caughtupriver"
)

const (
	tokensMetric = "caughtup.river.tokens"
	readsMetric  = "caughtup.river.position.reads"
)

// A job inserted with InsertTx in the writing transaction has no token:
// while every replica is paused it is snoozed (never run stale, never sent
// to the primary), its snoozes spend no attempt, and after replay resumes
// it runs on a replica and finds its row.
func TestInsertTxSnoozesUntilCaughtUp(t *testing.T) {
	e := setup(t, func(c *consume.Config) {
		c.WaitBudget = 100 * time.Millisecond
		c.DeferInitial = 200 * time.Millisecond
	})
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{})), true)
	resume := e.pauseAll(t)
	res := e.insertTx(t, ctx, c, 1)

	deadline := time.Now().Add(time.Minute)
	for e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": "deferred"}) < 2 {
		require.True(t, time.Now().Before(deadline), "the job was not deferred twice within a minute of paused replay")
		select {
		case r := <-runs:
			t.Fatalf("the job ran while every replica was paused: %+v", r)
		case <-time.After(50 * time.Millisecond):
		}
	}
	snoozed, err := c.JobGet(ctx, res.Job.ID)
	require.NoError(t, err)
	// Snoozed (0: River restored the attempt it counted at the fetch) or
	// fetched again (1), never more.
	require.LessOrEqual(t, snoozed.Attempt, 1, "a snooze restores the attempt River counted at the fetch")
	require.Empty(t, snoozed.Errors, "a snooze records no error")

	resume()
	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, value(1), r.val)
	require.Contains(t, []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited}, r.decision.Outcome, "decision %+v", r.decision)
	require.Equal(t, 1, r.attempt, "the run after the snoozes is the job's first attempt")
	require.Positive(t, e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "fetch"}))

	done := waitState(t, c, res.Job.ID, rivertype.JobStateCompleted)
	require.Equal(t, 1, done.Attempt)
	require.Empty(t, done.Errors)
	var md struct {
		Snoozes int `json:"snoozes"`
	}
	require.NoError(t, json.Unmarshal(done.Metadata, &md))
	require.GreaterOrEqual(t, md.Snoozes, 2, "River counts the snoozes in the metadata")
}

// waitState polls the job until it reaches state.
func waitState(t testing.TB, c interface {
	JobGet(context.Context, int64) (*rivertype.JobRow, error)
}, id int64, state rivertype.JobState) *rivertype.JobRow {
	t.Helper()
	var job *rivertype.JobRow
	require.Eventually(t, func() bool {
		var err error
		job, err = c.JobGet(context.Background(), id)
		return err == nil && job.State == state
	}, time.Minute, 20*time.Millisecond, "job %d never reached %s", id, state)
	return job
}

// A job inserted with Insert after the commit carries the commit's token
// in its metadata and costs no position read.
func TestMetadataTokenNeedsNoRead(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{})), true)
	wctx := e.write(t, ctx, 1)
	res, err := caughtupriver.Insert(wctx, c, itemArgs{ID: 1}, &river.InsertOpts{Metadata: []byte(`{"app":"x"}`)})
	require.NoError(t, err)
	tok, ok, err := caughtupriver.TokenOf(res.Job)
	require.NoError(t, err)
	require.True(t, ok)
	want, _ := enqueue.TokenFrom(wctx)
	require.Equal(t, want.Entries, tok.Entries)
	require.JSONEq(t, `"x"`, string(mustField(t, res.Job.Metadata, "app")), "the caller's metadata is kept")

	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, value(1), r.val)
	require.Equal(t, int64(1), e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "metadata"}))
	require.Zero(t, e.sum(t, readsMetric, nil), "a job with a metadata token needs no read of the primary")
}

func mustField(t testing.TB, md []byte, key string) json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(md, &m))
	return m[key]
}

// Metadata that does not decode reads the primary, is counted by the
// router and by the middleware, logged once per source, and never fails
// the job.
func TestMalformedMetadataReadsPrimary(t *testing.T) {
	logs := newLogRecords(slog.LevelWarn)
	e := setup(t, func(c *consume.Config) { c.Logger = slog.New(logs) })
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{})), true)
	e.write(t, ctx, 1)
	e.write(t, ctx, 2)
	for id, md := range map[int64]string{
		1: `{"caughtup-token":"v1;zz;main=p.1.1.not-an-lsn"}`,
		2: `{"caughtup-token":42}`,
	} {
		_, err := c.Insert(ctx, itemArgs{ID: id}, &river.InsertOpts{Metadata: []byte(md)})
		require.NoError(t, err)
	}
	for range 2 {
		r := next(t, runs, time.Minute)
		require.NoError(t, r.err)
		require.Equal(t, value(r.id), r.val)
		require.Equal(t, consume.OutcomePrimaryNoToken, r.decision.Outcome)
		require.Equal(t, consume.ReasonMalformedToken, r.decision.Reason)
	}
	require.Equal(t, int64(2), e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.reason": "malformed_token"}))
	require.Equal(t, int64(2), e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "malformed"}))
	// The warning names the source; other warnings may come first.
	for found := false; !found; {
		rec := logs.next(t, time.Minute)
		rec.Attrs(func(a slog.Attr) bool {
			found = found || (a.Value.String() == "river item" && rec.Level == slog.LevelWarn)
			return true
		})
	}
}

// With UnstampedReadPrimary a job without a metadata token reads the
// primary, counted as having no token.
func TestUnstampedReadPrimary(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{UnstampedReadPrimary: true})), true)
	e.insertTx(t, ctx, c, 1)
	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, consume.OutcomePrimaryNoToken, r.decision.Outcome)
	require.Equal(t, consume.ReasonNoToken, r.decision.Reason)
	require.Zero(t, e.sum(t, readsMetric, nil))
	require.Equal(t, int64(1), e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "none"}))
}

// Many jobs fetched together share reads of the primary's position, the
// jobs a read's scan saw waiting need none, and every one reads its row.
func TestFetchPositionShared(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t)
	const jobs = 300
	w, runs := recorder()
	c := e.client(t, clientConfig(50, w, e.middleware(t, caughtupriver.Config{})), false)
	tx, err := e.primary.Begin(ctx)
	require.NoError(t, err)
	params := make([]river.InsertManyParams, 0, jobs)
	for id := int64(1); id <= jobs; id++ {
		_, err := tx.Exec(ctx, `INSERT INTO items (id, val) VALUES ($1, $2)`, id, value(id))
		require.NoError(t, err)
		params = append(params, river.InsertManyParams{Args: itemArgs{ID: id}})
	}
	_, err = c.InsertManyTx(ctx, tx, params)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { require.NoError(t, c.Stop(context.Background())) })
	for range jobs {
		r := next(t, runs, time.Minute)
		require.NoError(t, r.err)
		require.Equal(t, value(r.id), r.val)
	}
	reads := e.sum(t, readsMetric, map[string]string{"caughtup.result": "ok"})
	t.Logf("%d jobs, %d position reads", jobs, reads)
	require.Positive(t, reads)
	require.Less(t, reads, int64(jobs), "jobs fetched together share position reads")
	fetched := e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "fetch"})
	earlier := e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "earlier_read"})
	require.Equal(t, int64(jobs), fetched+earlier)
	require.Positive(t, earlier, "the first read's scan saw the jobs waiting behind the first batch")
}

// A unique job's metadata token is merged with the position read after
// the fetch: River may have skipped a duplicate insert whose writes the
// token does not cover. The replicas have the first write and not the
// duplicate's, so a job routed by its metadata alone would read them
// stale.
func TestUniqueJobReadsFetchPosition(t *testing.T) {
	e := setup(t, func(c *consume.Config) { c.WaitBudget = 50 * time.Millisecond; c.DeferInitial = 100 * time.Millisecond })
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{})), false)
	wctx := e.write(t, ctx, 1)
	opts := &river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}
	_, err := caughtupriver.Insert(wctx, c, itemArgs{ID: 1}, opts)
	require.NoError(t, err)
	require.Nil(t, opts.Metadata, "Insert does not change the caller's options")
	require.NoError(t, e.cluster.WaitReplicasCaughtUp(ctx))
	resume := e.pauseAll(t)
	// A duplicate after a later write: skipped, and its write is not in
	// the surviving job's token.
	uctx, err := enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE items SET val = 'later' WHERE id = 1`)
		return err
	})
	require.NoError(t, err)
	dup, err := caughtupriver.Insert(uctx, c, itemArgs{ID: 1}, opts)
	require.NoError(t, err)
	require.True(t, dup.UniqueSkippedAsDuplicate)
	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { require.NoError(t, c.Stop(context.Background())) })
	deadline := time.Now().Add(time.Minute)
	for e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": "deferred"}) == 0 {
		require.True(t, time.Now().Before(deadline), "the unique job was not deferred within a minute")
		select {
		case r := <-runs:
			t.Fatalf("the unique job ran before the replicas had the duplicate's write: %+v", r)
		case <-time.After(20 * time.Millisecond):
		}
	}
	resume()
	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, "later", r.val, "the unique job saw the duplicate's write")
	require.Positive(t, e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "metadata_fetch"}))
	require.Zero(t, e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "metadata"}))
}

// A job on its last attempt that the fallback cap refuses is held in its
// worker instead of failing, which would discard it.
func TestLastAttemptHeldNotDiscarded(t *testing.T) {
	e := setup(t, func(c *consume.Config) {
		c.PrimaryRate, c.PrimaryBurst = 0.5, 1
		c.WaitBudget = 50 * time.Millisecond
	})
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{DefaultPolicy: consume.Sticky})), true)
	resume := e.pauseAll(t)
	defer resume()
	// Sticky, every replica behind: each job needs the primary; the burst
	// of one admits one, the next waits for the cap.
	for id := int64(1); id <= 2; id++ {
		wctx := e.write(t, ctx, id)
		_, err := caughtupriver.Insert(wctx, c, itemArgs{ID: id}, &river.InsertOpts{MaxAttempts: 1})
		require.NoError(t, err)
	}
	for range 2 {
		r := next(t, runs, time.Minute)
		require.NoError(t, r.err)
		require.Equal(t, value(r.id), r.val)
		require.Equal(t, 1, r.attempt)
	}
	require.Positive(t, e.sum(t, "caughtup.river.overrides", map[string]string{"caughtup.river.override": "last_attempt"}))
	n, err := c.JobList(ctx, river.NewJobListParams().States(rivertype.JobStateDiscarded))
	require.NoError(t, err)
	require.Empty(t, n.Jobs, "no job was discarded")
}

func TestNewMiddlewareRefuses(t *testing.T) {
	e := setup(t)
	for name, cfg := range map[string]caughtupriver.Config{
		"unknown database": {Database: "billing"},
		"bad database":     {Database: "no spaces"},
		"bad policy":       {DefaultPolicy: 9},
		"bad kind policy":  {Policies: map[string]consume.Policy{"item": 9}},
		"empty kind":       {Policies: map[string]consume.Policy{" ": consume.Delayed}},
		"negative timeout": {PositionTimeout: -time.Second},
	} {
		_, err := caughtupriver.NewMiddleware(e.router, cfg)
		require.ErrorIs(t, err, caughtupriver.ErrInvalidConfig, name)
	}
	_, err := caughtupriver.NewMiddleware(nil, caughtupriver.Config{})
	require.ErrorIs(t, err, caughtupriver.ErrInvalidConfig)
	_, err = caughtupriver.NewMiddleware(e.router, caughtupriver.Config{Database: "billing", UnstampedReadPrimary: true})
	require.NoError(t, err, "without the position read the database is not used")
}

// logRecords is a slog.Handler that sends every record at or above a level
// to a channel.
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

// A position read that fails (here: a timeout no read can meet) sends the
// job to the primary, counted and logged, and the job runs.
func TestFailedPositionReadReadsPrimary(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t)
	logs := newLogRecords(slog.LevelWarn)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{PositionTimeout: time.Nanosecond, Logger: slog.New(logs)})), true)
	e.insertTx(t, ctx, c, 1)
	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, value(1), r.val)
	// Without a token, as far as the router can tell.
	require.Equal(t, consume.OutcomePrimaryNoToken, r.decision.Outcome)
	require.Equal(t, consume.ReasonNoToken, r.decision.Reason)
	require.Equal(t, int64(1), e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "fetch_failed"}))
	require.Equal(t, int64(1), e.sum(t, readsMetric, map[string]string{"caughtup.result": "failed"}))
	rec := logs.next(t, time.Minute)
	require.Contains(t, rec.Message, "reads the primary")
}

// childArgs is a job a handler inserts.
type childArgs struct {
	Parent int64 `json:"parent"`
}

func (childArgs) Kind() string { return "child" }

type childWorker struct {
	river.WorkerDefaults[childArgs]
	jobs chan *rivertype.JobRow
}

func (w *childWorker) Work(_ context.Context, job *river.Job[childArgs]) error {
	w.jobs <- job.JobRow
	return nil
}

// A handler that inserts jobs with Insert from its routed context stamps
// them with at least its own job's token; InsertMany stamps every job.
func TestHandlerInsertsCarryTheRoutedToken(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t)
	cw := &childWorker{jobs: make(chan *rivertype.JobRow, 8)}
	parent := &itemWorker{fn: func(ctx context.Context, job *river.Job[itemArgs]) error {
		c := river.ClientFromContext[pgx.Tx](ctx)
		if _, err := caughtupriver.Insert(ctx, c, childArgs{Parent: job.Args.ID}, nil); err != nil {
			return err
		}
		_, err := caughtupriver.InsertMany(ctx, c, []river.InsertManyParams{{Args: childArgs{Parent: -1}}, {Args: childArgs{Parent: -2}}})
		return err
	}}
	cfg := clientConfig(4, parent, e.middleware(t, caughtupriver.Config{}))
	river.AddWorker(cfg.Workers, cw)
	c := e.client(t, cfg, true)
	wctx := e.write(t, ctx, 1)
	_, err := caughtupriver.Insert(wctx, c, itemArgs{ID: 1}, nil)
	require.NoError(t, err)
	produced, _ := enqueue.TokenFrom(wctx)
	want, _ := produced.Entry("main")
	for range 3 {
		select {
		case job := <-cw.jobs:
			tok, ok, err := caughtupriver.TokenOf(job)
			require.NoError(t, err)
			require.True(t, ok, "the child job carries a token")
			have, _ := tok.Entry("main")
			require.Equal(t, want.Epoch, have.Epoch)
			require.GreaterOrEqual(t, have.LSN, want.LSN, "the child's token is behind its parent's")
		case <-time.After(time.Minute):
			t.Fatal("the child jobs did not run within a minute")
		}
	}
}

// Always reads the primary whatever the token, so it costs no read; the
// router's default policy counts as set on the middleware.
func TestAlwaysSkipsTheRead(t *testing.T) {
	e := setup(t, func(c *consume.Config) { c.DefaultPolicy = consume.Always })
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{Policies: map[string]consume.Policy{"item": consume.PolicyDefault}})), true)
	e.insertTx(t, ctx, c, 1)
	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, value(1), r.val)
	require.Equal(t, consume.Always, r.decision.Policy)
	require.Zero(t, e.sum(t, readsMetric, nil))
	require.Equal(t, int64(1), e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "always"}))
}
