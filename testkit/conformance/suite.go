package conformance

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Config says how to run the suite for one adapter.
type Config struct {
	// NewDriver returns a fresh driver (its own queue or topic) for one
	// scenario. Required.
	NewDriver func(t *testing.T) Driver
	// Jobs is the size of the fresh-reads scenario. Default 1000; the
	// issues' acceptance runs use 10,000.
	Jobs int
	// MaxPause bounds each random replay pause. Default 3s.
	MaxPause time.Duration
	// Router adjusts the router's config for the adapter (shorter
	// MaxAge, say). Optional.
	Router func(*consume.Config)
	// Producers is how many goroutines produce at once. Default 8.
	Producers int
	// BalancedJobs is the size of the balanced-pool scenario, in which the
	// router's replica pool reaches both standbys through an HAProxy round
	// robin. Default 1000.
	BalancedJobs int
	// UnreachableFor is how long, in the unreachable-replica scenario,
	// new connections to replica 1 are reset while the tracker calls it
	// healthy. Default 60s: long enough for the replica's exclusion to
	// grow to its bound and be re-probed.
	UnreachableFor time.Duration
	// UnreachableJobs is the size of the unreachable-replica scenario,
	// produced evenly over UnreachableFor. Default 200.
	UnreachableJobs int
	// OnReport receives the fresh-reads, the balanced-pool and the
	// unreachable-replica scenarios' figures (Report.Scenario says
	// which), for closing notes and benchmarks. Optional.
	OnReport func(Report)
}

func (c Config) withDefaults() Config {
	if c.Jobs == 0 {
		c.Jobs = 1000
	}
	if c.MaxPause == 0 {
		c.MaxPause = 3 * time.Second
	}
	if c.Producers == 0 {
		c.Producers = 8
	}
	if c.BalancedJobs == 0 {
		c.BalancedJobs = 1000
	}
	if c.UnreachableFor == 0 {
		c.UnreachableFor = time.Minute
	}
	if c.UnreachableJobs == 0 {
		c.UnreachableJobs = 200
	}
	return c
}

// Report is what the fresh-reads or the balanced-pool scenario measured,
// for closing notes.
type Report struct {
	// Scenario is the subtest that measured it.
	Scenario                  string
	Jobs, Stale, Lost, Runs   int
	ReplicaRuns, PrimaryRuns  int
	Deferrals, Waits, Retried int64
	// DeadLettered is what the queue set aside after a job's last failed
	// attempt (asynq archives, Kafka's dead-letter topic), for drivers
	// that implement DeadLetterCounter; -1 for the others.
	DeadLettered int
	// Failed counts handler runs whose read failed, the queue retried
	// them; ReplicaFailed counts those a replica of the router's failed
	// (consume.ReplicaFailed: unreachable, or only servers behind the job
	// behind it), which the adapter must route again without counting an
	// attempt.
	Failed, ReplicaFailed int
	// Connections counts routed acquires of replica connections by
	// result (caughtup.consume.replica.connections: same_server,
	// verified, in_transaction, behind).
	Connections map[string]int64
	Elapsed     time.Duration
}

// ReplicaShare is the fraction of handler runs that read a replica.
func (r Report) ReplicaShare() float64 {
	if r.Runs == 0 {
		return 0
	}
	return float64(r.ReplicaRuns) / float64(r.Runs)
}

func (r Report) String() string {
	return fmt.Sprintf("jobs=%d stale=%d lost=%d dead_lettered=%d runs=%d failed_runs=%d replica_failed_runs=%d replica_share=%.3f primary_runs=%d deferrals=%d retried_without_failure=%d connections=%v elapsed=%s",
		r.Jobs, r.Stale, r.Lost, r.DeadLettered, r.Runs, r.Failed, r.ReplicaFailed, r.ReplicaShare(), r.PrimaryRuns, r.Deferrals, r.Retried, r.Connections, r.Elapsed.Round(time.Millisecond))
}

// Run runs every scenario against the adapter. Scenarios run one after
// another: they pause replay on the package's shared cluster, which
// parallel tests would see too.
func Run(t *testing.T, cfg Config) {
	cfg = cfg.withDefaults()
	require.NotNil(t, cfg.NewDriver, "conformance.Config.NewDriver is required")
	t.Run("FreshReadsUnderRandomPauses", func(t *testing.T) {
		rep := FreshReads(t, cfg)
		if cfg.OnReport != nil {
			cfg.OnReport(rep)
		}
	})
	t.Run("BalancedPoolUnderRandomPauses", func(t *testing.T) {
		rep := Balanced(t, cfg)
		if cfg.OnReport != nil {
			cfg.OnReport(rep)
		}
	})
	t.Run("UnreachableReplica", func(t *testing.T) {
		rep := Unreachable(t, cfg)
		if cfg.OnReport != nil {
			cfg.OnReport(rep)
		}
	})
	t.Run("ReplicaFailsRunRoutedAgain", func(t *testing.T) {
		rep := ReplicaFailsRun(t, cfg)
		if cfg.OnReport != nil {
			cfg.OnReport(rep)
		}
	})
	t.Run("MissingTokenReadsPrimary", func(t *testing.T) { badHeader(t, cfg, "", consume.ReasonNoToken) })
	t.Run("MalformedTokenReadsPrimary", func(t *testing.T) { badHeader(t, cfg, "v1;zz;main=p.1.1.not-an-lsn", consume.ReasonMalformedToken) })
	t.Run("ForeignEpochReadsPrimary", func(t *testing.T) { foreignEpoch(t, cfg) })
	t.Run("StickyBehindReadsPrimary", func(t *testing.T) { stickyBehind(t, cfg) })
	t.Run("DelayedDefersUntilCaughtUp", func(t *testing.T) { delayedDefers(t, cfg) })
	t.Run("HandlerEnqueuesWithReadPosition", func(t *testing.T) { handlerToken(t, cfg) })
}

// env is one scenario's database, pools, router and metrics.
type env struct {
	cluster  *pgtest.Cluster
	primary  *pgxpool.Pool
	replicas []*pgxpool.Pool
	router   *consume.Router
	reader   *sdkmetric.ManualReader
}

func setup(t *testing.T, cfg Config) *env { return setupWith(t, cfg, nil) }

// setupWith is setup with the router's replicas of "main" chosen by
// replicas (given the database's name); nil means one pool per standby.
func setupWith(t *testing.T, cfg Config, replicas func(db string) []replay.Replica) *env {
	t.Helper()
	ctx := t.Context()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	e := &env{cluster: c, reader: sdkmetric.NewManualReader()}
	var err error
	e.primary, err = c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	_, err = e.primary.Exec(ctx, `CREATE TABLE items (id bigint PRIMARY KEY, val text NOT NULL)`)
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	for _, n := range c.Replicas() {
		p, err := n.Pool(ctx, db)
		require.NoError(t, err)
		e.replicas = append(e.replicas, p)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(e.reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	reps := replay.Replicas(e.replicas...)
	if replicas != nil {
		reps = replicas(db)
	}
	rc := consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: e.primary, Replicas: reps}},
		MeterProvider: mp,
		// Paused replicas are the point here; their warnings are noise.
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
	}
	if cfg.Router != nil {
		cfg.Router(&rc)
	}
	e.router, err = consume.NewRouter(ctx, rc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.router.Close() })
	return e
}

// write inserts a row on the primary and returns ctx carrying its token.
func (e *env) write(ctx context.Context, id int64) (context.Context, error) {
	return enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO items (id, val) VALUES ($1, $2)`, id, value(id))
		return err
	})
}

func value(id int64) string { return fmt.Sprintf("v%d", id) }

// outcomeCount sums the decisions counter for one outcome.
func (e *env) outcomeCount(t *testing.T, outcome consume.Outcome) int64 {
	t.Helper()
	return metrictest.Sum(t, e.reader, "caughtup.consume.decisions", attribute.String("caughtup.outcome", outcome.String()))
}

// checker records every handler run: what it read, where, and how often.
type checker struct {
	mu       sync.Mutex
	runs     map[int64]int
	stale    []string
	outcomes map[consume.Outcome]int
	reasons  map[consume.Reason]int // of runs that read the primary
	retried  atomic.Int64
	failed   map[int64]bool // jobs whose handler returned a real error
	// failedRuns counts those errors; the queue retries each.
	failedRuns int
	// replicaFailedRuns counts failed reads that a replica of the
	// router's caused (consume.ReplicaFailed): the adapter routes those
	// again without counting an attempt, so they do not mark the job
	// failed.
	replicaFailedRuns int
	done              chan struct{}
	want              int
	finished          int
}

func newChecker(want int) *checker {
	return &checker{runs: map[int64]int{}, outcomes: map[consume.Outcome]int{}, reasons: map[consume.Reason]int{}, failed: map[int64]bool{}, done: make(chan struct{}), want: want}
}

// handler reads the job's row from the pool the adapter chose and records
// a stale read if it is missing or different.
func (c *checker) handler(d Driver) Handler {
	rc, _ := d.(RetryCounter)
	return func(ctx context.Context, job Job) error {
		dec, ok := consume.DecisionFrom(ctx)
		pool := consume.DB(ctx, "main")
		if !ok || pool == nil {
			c.fail(fmt.Sprintf("job %d: handler context has no routing decision", job.ID))
			return nil
		}
		var val string
		err := pool.QueryRow(ctx, `SELECT val FROM items WHERE id = $1`, job.ID).Scan(&val)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			c.fail(fmt.Sprintf("job %d: row not found (outcome %s, replica %q)", job.ID, dec.Outcome, replicaOf(dec)))
		case err != nil && consume.ReplicaFailed(ctx):
			c.mu.Lock()
			c.replicaFailedRuns++
			c.mu.Unlock()
			return err // the router's failure: the adapter routes the job again, not counting an attempt
		case err != nil:
			c.mu.Lock()
			c.failed[job.ID] = true
			c.failedRuns++
			c.mu.Unlock()
			return err // a real error: the adapter retries
		case val != value(job.ID):
			c.fail(fmt.Sprintf("job %d: read %q, want %q", job.ID, val, value(job.ID)))
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		// A retry after a real handler error is the queue's business; a
		// retry count that grew without one came from a deferral or a
		// replica's failure.
		if rc != nil && rc.RetryCount(ctx) > 0 && !c.failed[job.ID] {
			c.retried.Add(1)
		}
		c.outcomes[dec.Outcome]++
		if dec.Outcome != consume.OutcomeReplica && dec.Outcome != consume.OutcomeReplicaWaited {
			c.reasons[dec.Reason]++
		}
		c.runs[job.ID]++
		if c.runs[job.ID] == 1 {
			c.finished++
			if c.finished == c.want {
				close(c.done)
			}
		}
		return nil
	}
}

func replicaOf(d consume.Decision) string {
	if dd, ok := d.Database("main"); ok {
		return dd.Replica
	}
	return ""
}

func (c *checker) fail(msg string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stale = append(c.stale, msg)
}

// wait blocks until every job ran once or the timeout passes.
func (c *checker) wait(timeout time.Duration) bool {
	select {
	case <-c.done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// FreshReads is the main scenario: every job is produced right after its
// own insert while replay on one or both replicas pauses at random; every
// handler must find its row and every job must complete, with deferrals
// that never count as failed attempts.
func FreshReads(t *testing.T, cfg Config) Report {
	cfg = cfg.withDefaults()
	e := setup(t, cfg)
	rep := routed(t, cfg, e, cfg.NewDriver(t), cfg.Jobs, 0, func(ctx context.Context) {
		e.cluster.PauseRandomly(ctx, cfg.MaxPause, 500*time.Millisecond, t.Errorf)
	})
	rep.Scenario = "FreshReadsUnderRandomPauses"
	return rep
}

// routed produces jobs jobs through d, each right after its own insert
// (at most perSecond a second; 0: as fast as the producers go), while lag
// injects replica lag, runs them through the adapter under Delayed and
// checks every run: none stale, none lost, none set aside by the queue,
// no deferral counted as a failed attempt, and no read of the primary
// for a reason other than unknown replica state.
func routed(t *testing.T, cfg Config, e *env, d Driver, jobs int, perSecond rate.Limit, lag func(ctx context.Context)) Report {
	t.Helper()
	ctx := t.Context()
	chk := newChecker(jobs)
	start := time.Now()
	stop, err := d.Consume(ctx, e.router, consume.Delayed, chk.handler(d))
	require.NoError(t, err)

	pauseCtx, stopPauses := context.WithCancel(ctx)
	pauserDone := make(chan struct{})
	go func() {
		defer close(pauserDone)
		lag(pauseCtx)
	}()

	ids := make(chan int64)
	var wg sync.WaitGroup
	var produceErr atomic.Value
	for range cfg.Producers {
		wg.Go(func() {
			for id := range ids {
				pctx, err := e.write(ctx, id)
				if err == nil {
					err = d.Produce(pctx, Job{ID: id, Key: fmt.Sprintf("k%d", id%32)})
				}
				if err != nil {
					produceErr.CompareAndSwap(nil, fmt.Errorf("job %d: %w", id, err))
				}
			}
		})
	}
	pace := rate.NewLimiter(rate.Inf, 0)
	if perSecond > 0 {
		pace = rate.NewLimiter(perSecond, 1)
	}
	for i := 1; i <= jobs; i++ {
		if err := pace.Wait(ctx); err != nil {
			produceErr.CompareAndSwap(nil, fmt.Errorf("job %d: %w", i, err))
			break
		}
		ids <- int64(i)
	}
	close(ids)
	wg.Wait()
	stopPauses()
	<-pauserDone
	if err, _ := produceErr.Load().(error); err != nil {
		t.Fatalf("produce: %v", err)
	}

	completed := chk.wait(3*time.Minute + 10*cfg.MaxPause)
	require.NoError(t, stop())

	rep := Report{Jobs: jobs, DeadLettered: -1}
	if dl, ok := d.(DeadLetterCounter); ok {
		rep.DeadLettered, err = dl.DeadLettered(ctx)
		require.NoError(t, err, "counting the jobs the queue set aside")
	}
	chk.mu.Lock()
	defer chk.mu.Unlock()
	rep.Stale, rep.Elapsed, rep.Retried, rep.Failed, rep.ReplicaFailed = len(chk.stale), time.Since(start), chk.retried.Load(), chk.failedRuns, chk.replicaFailedRuns
	for id := int64(1); id <= int64(jobs); id++ {
		if chk.runs[id] == 0 {
			rep.Lost++
		}
		rep.Runs += chk.runs[id]
	}
	for o, n := range chk.outcomes {
		switch o {
		case consume.OutcomeReplica, consume.OutcomeReplicaWaited:
			rep.ReplicaRuns += n
		default:
			rep.PrimaryRuns += n
		}
	}
	rep.Deferrals = e.outcomeCount(t, consume.OutcomeDeferred)
	rep.Waits = int64(chk.outcomes[consume.OutcomeReplicaWaited])
	rep.Connections = map[string]int64{}
	for _, res := range []string{"same_server", "verified", "in_transaction", "behind"} {
		rep.Connections[res] = metrictest.Sum(t, e.reader, "caughtup.consume.replica.connections", attribute.String("caughtup.result", res))
	}
	t.Logf("%s: %s outcomes=%v", t.Name(), rep, chk.outcomes)

	if n := len(chk.stale); n > 0 {
		t.Fatalf("%d stale reads, e.g. %v", n, chk.stale[:min(n, 10)])
	}
	require.True(t, completed, "not every job completed: %d of %d", chk.finished, jobs)
	require.Zero(t, rep.Lost, "lost jobs")
	require.Zero(t, rep.Retried, "a deferral or a replica's failure counted as a failed attempt")
	require.LessOrEqual(t, rep.DeadLettered, 0, "jobs the queue set aside after their last attempt (archived, dead-lettered)")
	// Delayed never promotes to the primary for lag while the token is
	// younger than MaxAge: paused replicas are reachable and known, so a
	// job runs on a replica once one has caught up, after waiting or a
	// deferral if need be. Only unknown replica state (a tracker query
	// slower than the staleness bound on a loaded machine) may send one to
	// the primary.
	for reason, n := range chk.reasons {
		switch reason {
		case consume.ReasonTrackerStale, consume.ReasonNoHealthyReplica:
			t.Logf("%d runs read the primary for unknown replica state (%s)", n, reason)
		default:
			t.Errorf("%d delayed jobs read the primary for %s: outcomes %v", n, reason, chk.outcomes)
		}
	}
	return rep
}

// runOne produces one job with produce and returns its decision once the
// handler ran.
func runOne(t *testing.T, e *env, d Driver, policy consume.Policy, produce func() error) consume.Decision {
	t.Helper()
	got := make(chan consume.Decision, 4)
	stop, err := d.Consume(t.Context(), e.router, policy, func(ctx context.Context, job Job) error {
		dec, _ := consume.DecisionFrom(ctx)
		got <- dec
		return nil
	})
	require.NoError(t, err)
	defer func() { require.NoError(t, stop()) }()
	require.NoError(t, produce())
	select {
	case dec := <-got:
		return dec
	case <-time.After(time.Minute):
		t.Fatal("the job did not run within a minute")
	}
	return consume.Decision{}
}

func badHeader(t *testing.T, cfg Config, header string, reason consume.Reason) {
	e := setup(t, cfg)
	d := cfg.NewDriver(t)
	dec := runOne(t, e, d, consume.Delayed, func() error { return d.ProduceRaw(t.Context(), Job{ID: 1, Key: "k"}, header) })
	require.Equal(t, consume.OutcomePrimaryNoToken, dec.Outcome)
	require.Equal(t, reason, dec.Reason)
	require.Equal(t, int64(1), e.outcomeCount(t, consume.OutcomePrimaryNoToken), "the missing or malformed token is counted")
}

func foreignEpoch(t *testing.T, cfg Config) {
	e := setup(t, cfg)
	d := cfg.NewDriver(t)
	tok := position.New("main", position.Epoch{SystemID: 42, Timeline: 1}, 1, position.SourcePrimary, time.Now())
	dec := runOne(t, e, d, consume.Delayed, func() error {
		return d.Produce(enqueue.WithToken(t.Context(), tok), Job{ID: 1, Key: "k"})
	})
	require.Equal(t, consume.OutcomePrimaryEpoch, dec.Outcome)
	require.Equal(t, consume.ReasonEpoch, dec.Reason)
}

// pauseAll pauses replay everywhere and resumes at cleanup.
func pauseAll(t *testing.T, e *env) {
	t.Helper()
	for _, n := range e.cluster.Replicas() {
		require.NoError(t, n.PauseReplay(t.Context()))
	}
	t.Cleanup(func() { resumeAll(t, e) })
}

func resumeAll(t *testing.T, e *env) {
	for _, n := range e.cluster.Replicas() {
		if err := n.ResumeReplay(context.Background()); err != nil {
			t.Errorf("resume %s: %v", n.Name(), err)
		}
	}
}

func stickyBehind(t *testing.T, cfg Config) {
	e := setup(t, cfg)
	d := cfg.NewDriver(t)
	pauseAll(t, e)
	ctx, err := e.write(t.Context(), 1)
	require.NoError(t, err)
	dec := runOne(t, e, d, consume.Sticky, func() error { return d.Produce(ctx, Job{ID: 1, Key: "k"}) })
	require.Equal(t, consume.OutcomePrimary, dec.Outcome)
	require.Equal(t, consume.ReasonReplicaBehind, dec.Reason)
}

// delayedDefers pauses every replica for longer than the wait budget: the
// job must be deferred (not run stale, not sent to the primary) and run on
// a replica once replay resumes.
func delayedDefers(t *testing.T, cfg Config) {
	e := setup(t, cfg)
	d := cfg.NewDriver(t)
	pauseAll(t, e)
	ctx, err := e.write(t.Context(), 1)
	require.NoError(t, err)
	budget := e.router.Config().WaitBudget
	chk := newChecker(1)
	stop, err := d.Consume(t.Context(), e.router, consume.Delayed, chk.handler(d))
	require.NoError(t, err)
	defer func() { require.NoError(t, stop()) }()
	require.NoError(t, d.Produce(ctx, Job{ID: 1, Key: "k"}))
	deadline := time.Now().Add(time.Minute)
	for e.outcomeCount(t, consume.OutcomeDeferred) == 0 {
		require.True(t, time.Now().Before(deadline), "no deferral within a minute of paused replay")
		time.Sleep(budget / 5)
	}
	chk.mu.Lock()
	require.Zero(t, chk.finished, "the job ran while every replica was paused")
	chk.mu.Unlock()
	resumeAll(t, e)
	require.True(t, chk.wait(2*time.Minute), "the deferred job did not run after replay resumed")
	chk.mu.Lock()
	defer chk.mu.Unlock()
	require.Empty(t, chk.stale)
	require.Equal(t, 1, chk.outcomes[consume.OutcomeReplica]+chk.outcomes[consume.OutcomeReplicaWaited], "outcomes %v", chk.outcomes)
	require.Zero(t, chk.retried.Load(), "the deferral counted as a failed attempt")
}

// handlerToken checks that a handler's context carries, for jobs it
// enqueues, at least the job's token and the position of the replica it
// read.
func handlerToken(t *testing.T, cfg Config) {
	e := setup(t, cfg)
	d := cfg.NewDriver(t)
	ctx, err := e.write(t.Context(), 1)
	require.NoError(t, err)
	produced, _ := enqueue.TokenFrom(ctx)
	type seen struct {
		tok position.Token
		dec consume.Decision
	}
	got := make(chan seen, 4)
	stop, err := d.Consume(t.Context(), e.router, consume.Delayed, func(ctx context.Context, job Job) error {
		tok, _ := enqueue.TokenFrom(ctx)
		dec, _ := consume.DecisionFrom(ctx)
		got <- seen{tok, dec}
		return nil
	})
	require.NoError(t, err)
	defer func() { require.NoError(t, stop()) }()
	require.NoError(t, d.Produce(ctx, Job{ID: 1, Key: "k"}))
	var s seen
	select {
	case s = <-got:
	case <-time.After(time.Minute):
		t.Fatal("the job did not run within a minute")
	}
	want, _ := produced.Entry("main")
	have, ok := s.tok.Entry("main")
	require.True(t, ok, "handler context carries no token for main")
	require.Equal(t, want.Epoch, have.Epoch)
	require.GreaterOrEqual(t, have.LSN, want.LSN, "the handler's token is behind the job's")
	if dd, ok := s.dec.Database("main"); ok && dd.Replica != "" {
		require.GreaterOrEqual(t, have.LSN, dd.ReadAt.LSN, "the handler's token is behind the replica it read")
	}
}
