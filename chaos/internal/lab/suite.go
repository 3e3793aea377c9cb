package lab

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"regexp"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/netns"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// scale is how big and how long a run is.
type scale struct {
	jobs         int           // per scenario, half through asynq and half through Kafka (all through asynq when asynqOnly)
	lead         time.Duration // production before the fault
	tail         time.Duration // production after the fault
	pause        time.Duration // the long replay pause
	down         time.Duration // a crashed replica stays down this long
	wedge        time.Duration // tracker wedge
	redisDown    time.Duration
	capPause     time.Duration    // lag spike under the fallback cap
	holdLong     time.Duration    // replay-conflict hold beyond max_standby_streaming_delay
	holdShort    time.Duration    // replay-conflict hold released by the client
	standbyDelay time.Duration    // max_standby_streaming_delay of the clusters
	consumers    time.Duration    // spacing of the consumer kills and joins
	timeoutPause time.Duration    // timeout-tasks: replay paused this long
	timeouts     [2]time.Duration // timeout-tasks: the tasks' asynq.Timeout values
	maxPause     time.Duration    // comparison: longest random pause
	unreachable  time.Duration    // unreachable-replica: replica1 resets new connections this long
	compareFor   time.Duration    // comparison: production span
	drain        time.Duration    // how long to wait for the last jobs after production
}

var (
	fullScale = scale{
		jobs: 10000, lead: 5 * time.Second, tail: 5 * time.Second,
		pause: 30 * time.Second, down: 8 * time.Second, wedge: 10 * time.Second, redisDown: 5 * time.Second,
		capPause: 10 * time.Second, holdLong: 35 * time.Second, holdShort: 10 * time.Second, standbyDelay: 30 * time.Second,
		consumers: 5 * time.Second, maxPause: 5 * time.Second, compareFor: 40 * time.Second, drain: 3 * time.Minute,
		unreachable: time.Minute,
		// A token's deferral step reaches DeferMax (30s), which with 2s of
		// slack outlasts a Timeout(30s) attempt, once the token is 31s old
		// at a deferral; with asynq's whole-second retry times and the
		// waits in between, a task written as replay stops gets there
		// about 37s in. 45s makes the first ~8s of the pause's tasks do.
		timeoutPause: 45 * time.Second, timeouts: [2]time.Duration{2 * time.Second, 30 * time.Second},
	}
	shortScale = scale{
		jobs: 800, lead: 1500 * time.Millisecond, tail: 1500 * time.Millisecond,
		pause: 3 * time.Second, down: 2 * time.Second, wedge: 3 * time.Second, redisDown: 2 * time.Second,
		capPause: 3 * time.Second, holdLong: 6 * time.Second, holdShort: 3 * time.Second, standbyDelay: 4 * time.Second,
		consumers: 2 * time.Second, maxPause: 3 * time.Second, compareFor: 8 * time.Second, drain: 90 * time.Second,
		unreachable: 4 * time.Second,
		// The second deferral's step (2s) plus 2s of slack outlasts a
		// Timeout(4s) attempt: the full run's edge, scaled down.
		timeoutPause: 6 * time.Second, timeouts: [2]time.Duration{2 * time.Second, 4 * time.Second},
	}
)

// maxRate is the production rate scenarios are planned for: what this
// 2-core machine sustains with room to spare while it also runs three
// PostgreSQL servers, Redis, the broker and both consumers (it managed
// 350-750 jobs/s flat out, depending on what else ran).
const maxRate = 300

// span is how long production runs for a fault timeline of length t: at
// least long enough that jobs arrive at no more than maxRate.
func (s scale) span(t time.Duration) time.Duration {
	return max(t, time.Duration(s.jobs)*time.Second/maxRate)
}

type options struct {
	short bool
	scale scale
	only  *regexp.Regexp
	// caughtupBin is the caughtup binary the feed scenarios run their
	// publishers with; "" builds one (see feedTools).
	caughtupBin string
}

// scenario is one fault timeline run against both adapters at once. A
// new scenario lives in a file of its own, with a constructor that
// scenarioList names (see scenarios.go).
type scenario struct {
	name  string
	about string
	// fresh: the scenario promotes a replica, so it gets its own cluster,
	// with replicas replicas (default 2).
	fresh    bool
	replicas int
	// settings are extra postgresql.conf settings of the scenario's own
	// cluster.
	settings map[string]string
	// movablePrimary: the producers' and the router's primary pools connect
	// to whichever node dbEnv.movePrimary last named, instead of the
	// multi-host read-write URL (see newDBEnv).
	movablePrimary bool
	policy         consume.Policy
	router         func(*consume.Config)
	// replicaPools, if set, returns the router's replica pools of "main"
	// instead of newDBEnv's one direct pool per standby (a balancer in
	// front of them, say); the router is rebuilt on them before the
	// pipelines start. What it opens it closes through run.closers.
	replicaPools func(ctx context.Context, r *run) ([]replay.Replica, error)
	// configure, if set, changes the router's config with the run at
	// hand (the services, run.closers), after router: a position feed's
	// Redis client, say.
	configure func(r *run, c *consume.Config) error
	// asynqOnly: every job goes through asynq; there is no Kafka pipeline.
	asynqOnly bool
	// kafkaRoutes: the kafka-go Consumers route each message themselves
	// with the scenario's policy, as an application's do, instead of
	// handing it on (consume.Always) to caughtupkafka.Middleware in the
	// handler; a run a replica failed (consume.ReplicaFailed) is then the
	// Consumer's to route again without spending an attempt. Their waits
	// and deferrals, which the handler never sees, are counted from the
	// consumers' caughtup.kafka.messages (foldKafkaWaits).
	kafkaRoutes bool
	// retryTopic adds a third pipeline, a Kafka consumer in RetryTopic
	// mode on a topic of its own, beside the in-place one: jobs then
	// alternate between asynq, Kafka in place and Kafka retry topic.
	retryTopic bool
	// river and kgo add the River and franz-go pipelines (adapters.go):
	// river two lanes, jobs inserted with caughtupriver.Insert and with
	// River's InsertTx, kgo one, through caughtupkgo's Producer and
	// Consumer on a topic of its own. Jobs alternate between every
	// pipeline of the scenario.
	river, kgo bool
	// taskOptions, if set, are extra options of each job's asynq task.
	taskOptions func(p payload) []asynq.Option
	// span is how long production runs; fault runs alongside it.
	span func(s scale) time.Duration
	// delay, if set, enqueues jobs that long after their write.
	delay func(r *rand.Rand) time.Duration
	// prepare, if set, runs once the database, the router and the
	// pipelines exist, before production: extra pools and producers
	// (run.extra).
	prepare func(ctx context.Context, r *run) error
	fault   func(ctx context.Context, r *run) error
	// judge, if set, runs after the drain, before the tables: it may
	// re-judge reads whose staleness depends on what the fault did
	// (stream.rejudge).
	judge func(ctx context.Context, r *run) error
	check func(r *run, res *scenarioResult)
}

// run is one scenario in progress.
type run struct {
	s       *services
	sc      *scenario
	sl      scale
	cluster *pgtest.Cluster
	env     *dbEnv
	start   time.Time

	queue, topic, group string
	asynqPipe           *asynqPipe
	kafkaPipe           *kafkaPipe
	asynqClient         *asynq.Client
	// inspector wakes the asynq servers' deferred tasks (Middleware's
	// Inspector); closed after the last server.
	inspector *asynq.Inspector
	ast, kst  *stream
	// The RetryTopic pipeline (scenario.retryTopic): its topic (and
	// consumer group), producer, stream and consumer.
	retryTopic  string
	retryPipe   *kafkaPipe
	rst         *stream
	retryMember *kafkaMember
	// adapters are the River and franz-go pipelines (scenario.river,
	// scenario.kgo); nil without them.
	adapters *adapterPipes
	// follower records the router's snapshots during production and the
	// drain, for the catch-up → start latency; pausedAll are the spans
	// during which the fault had replay paused on every replica.
	follower  *snapFollower
	pausedAll []pauseSpan
	work      *workload
	// extra are producers besides the scenario's main workload, writing
	// through the same lanes (the diverged standby's split-brain writer).
	extra []*workload
	// metrics collects what the router, the asynq middleware and the
	// Kafka consumer count, for the scenario's checks (overrides).
	metrics *runMetrics
	// state is a scenario's own bookkeeping, set by its prepare or fault
	// function and read by its judge and check.
	state any
	// closers run when the scenario ends, last first (pools a prepare
	// function opened).
	closers []func()
	// namespaces are the run's network namespaces by role (run.namespace).
	namespaces map[string]*netns.Namespace

	// What the fault timelines measured, for their checks.
	failoverStart, failoverEnd time.Time
	wedgeFrom, wedgeTo         time.Time
	stalls                     []time.Duration
	redisHeld                  int
	// redisStopped is when the fault last stopped redis-server: tasks
	// whose state asynq could not write then come back only through its
	// recoverer (see asynqLeaseRecovery), which the drain waits for.
	redisStopped time.Time
	crashesSeen  int

	mu       sync.Mutex
	srvs     []*asynq.Server
	members  []*kafkaMember
	events   []event
	notes    []string
	failures []string
}

type event struct {
	At   float64 `json:"at_s"`
	What string  `json:"what"`
}

func (r *run) event(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	at := 0.0 // before production starts (a prepare function's events)
	if !r.start.IsZero() {
		at = time.Since(r.start).Seconds()
	}
	r.mu.Lock()
	r.events = append(r.events, event{At: at, What: msg})
	r.mu.Unlock()
	r.s.out.say("%s: %s", r.sc.name, msg)
}

func (r *run) note(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.notes = append(r.notes, fmt.Sprintf(format, args...))
}

func (r *run) fail(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}

// at sleeps until d after the scenario started.
func (r *run) at(ctx context.Context, d time.Duration) error {
	if w := time.Until(r.start.Add(d)); w > 0 {
		if !sleepCtx(ctx, w) {
			return ctx.Err()
		}
	}
	return nil
}

// scenarioResult is one scenario's table.
type scenarioResult struct {
	Name           string         `json:"name"`
	About          string         `json:"about"`
	Policy         string         `json:"policy"`
	Jobs           int            `json:"jobs"`
	Split          string         `json:"split"`
	Streams        []streamResult `json:"streams"`
	CapRate        float64        `json:"cap_rate_per_s"`
	CapBurst       int            `json:"cap_burst"`
	CapWindowLimit int            `json:"cap_limit_per_1s_window"`
	WriteRetries   int64          `json:"producer_write_retries"`
	SendRetries    int64          `json:"producer_enqueue_retries"`
	ProduceSeconds float64        `json:"production_s"`
	WriteMeanMS    float64        `json:"producer_write_mean_ms"`
	SendMeanMS     float64        `json:"producer_enqueue_mean_ms"`
	Seconds        float64        `json:"elapsed_s"`
	// SnapshotsRecorded are the router snapshots the catch-up latency was
	// measured from, SnapshotsSkipped those the follower missed.
	SnapshotsRecorded int      `json:"snapshots_recorded"`
	SnapshotsSkipped  uint64   `json:"snapshots_skipped"`
	Events            []event  `json:"events"`
	Notes             []string `json:"notes,omitempty"`
	Failures          []string `json:"failures,omitempty"`
	// Forged is what forged-feed injected and what was rejected.
	Forged *forgedResult `json:"forged,omitempty"`
}

// runScenario sets a scenario up on its cluster, produces its jobs while
// its fault runs, waits for every job to complete, and checks the result.
func runScenario(ctx context.Context, s *services, sc *scenario) (res scenarioResult) {
	sl := s.opts.scale
	res = scenarioResult{Name: sc.name, About: sc.about, Policy: policyName(sc.policy)}
	began := time.Now()
	defer func() { res.Seconds = time.Since(began).Seconds() }()
	r := &run{s: s, sc: sc, sl: sl, cluster: s.cluster, metrics: newRunMetrics()}
	defer r.metrics.close()
	r.queue = s.name(sc.name)
	r.topic = r.queue
	r.group = r.queue
	r.ast = newStream("asynq", "asynq", "caughtup")
	if !sc.asynqOnly {
		r.kst = newStream("kafka", "kafka", "caughtup")
		if sc.retryTopic {
			r.retryTopic = s.name(sc.name + "-rt")
			r.rst = newStream("kafka-retry", "kafka", "caughtup")
		}
	}

	if sc.fresh {
		opts := clusterOptions(s.opts, s.out)
		if sc.replicas > 0 {
			opts.Replicas = sc.replicas
		}
		for k, v := range sc.settings {
			opts.Settings[k] = v
		}
		s.out.say("%s: starting a cluster of its own (the scenario promotes a replica): a primary and %d replicas", sc.name, opts.Replicas)
		c, err := pgtest.Start(ctx, opts)
		if err != nil {
			res.Failures = append(res.Failures, fmt.Sprintf("start cluster: %v", err))
			return res
		}
		defer c.Close()
		r.cluster = c
	}
	// Before the cluster closes.
	defer func() {
		for i := len(r.closers) - 1; i >= 0; i-- {
			r.closers[i]()
		}
	}()
	rc := consume.Config{DefaultPolicy: sc.policy, MeterProvider: r.metrics.provider}
	if sc.router != nil {
		sc.router(&rc)
	}
	if sc.configure != nil {
		if err := sc.configure(r, &rc); err != nil {
			res.Failures = append(res.Failures, fmt.Sprintf("configure the router: %v", err))
			return res
		}
	}
	env, err := newDBEnv(ctx, s, r.cluster, sc.name, rc, sc.movablePrimary)
	if err != nil {
		res.Failures = append(res.Failures, fmt.Sprintf("set up database and router: %v", err))
		return res
	}
	r.env = env
	if sc.replicaPools != nil {
		if err := r.rebuildRouter(ctx, rc); err != nil {
			env.close()
			res.Failures = append(res.Failures, fmt.Sprintf("set up the replica pools: %v", err))
			return res
		}
	}
	cfg := env.router.Config()
	res.CapRate, res.CapBurst = float64(cfg.PrimaryRate), cfg.PrimaryBurst
	res.CapWindowLimit = int(float64(cfg.PrimaryRate)) + cfg.PrimaryBurst

	if err := r.startPipelines(ctx); err != nil {
		r.stopPipelines()
		env.close()
		res.Failures = append(res.Failures, fmt.Sprintf("start pipelines: %v", err))
		return res
	}
	span := sc.span(sl)
	lanes := []*lane{{name: "asynq", sinks: []sink{{send: r.asynqPipe.send, streams: []*stream{r.ast}}}}}
	if r.kst != nil {
		lanes = append(lanes, &lane{name: "kafka", sinks: []sink{{send: r.kafkaPipe.send, streams: []*stream{r.kst}}}})
	}
	if r.rst != nil {
		lanes = append(lanes, &lane{name: "kafka-retry", sinks: []sink{{send: r.retryPipe.send, streams: []*stream{r.rst}}}})
	}
	lanes = append(lanes, r.adapters.lanes()...)
	r.work = &workload{
		pool: env.producer, jobs: sl.jobs, over: span, workers: 8, keys: int64(max(sl.jobs/4, 50)), delay: sc.delay,
		lanes: lanes,
	}
	if sc.prepare != nil {
		if err := sc.prepare(ctx, r); err != nil {
			r.stopPipelines()
			env.close()
			res.Failures = append(res.Failures, fmt.Sprintf("prepare: %v", err))
			return res
		}
	}
	s.out.say("%s: %s", sc.name, sc.about)
	switch {
	case r.adapters != nil:
		s.out.say("%s: producing %d jobs over %s (split %d ways, concurrently: %s)", sc.name, sl.jobs, span.Round(100*time.Millisecond), len(lanes), laneNames(lanes))
	case r.rst != nil:
		s.out.say("%s: producing %d jobs over %s (a third each through asynq, kafka in place and kafka retry topic, concurrently)", sc.name, sl.jobs, span.Round(100*time.Millisecond))
	case r.kst != nil:
		s.out.say("%s: producing %d jobs over %s (%d asynq + %d kafka, concurrently)", sc.name, sl.jobs, span.Round(100*time.Millisecond), sl.jobs/2, sl.jobs-sl.jobs/2)
	default:
		s.out.say("%s: producing %d asynq jobs over %s", sc.name, sl.jobs, span.Round(100*time.Millisecond))
	}

	// The whole scenario is bounded; a wedged fault or consumer must not
	// hang the suite.
	sctx, cancel := context.WithTimeout(ctx, span+sl.drain+2*time.Minute)
	defer cancel()
	r.follower = followSnapshots(env.router)
	defer r.follower.stop()
	r.start = time.Now()
	var wg sync.WaitGroup
	var faultErr error
	wg.Go(func() { faultErr = sc.fault(sctx, r) })
	for _, w := range r.extra {
		wg.Go(func() { w.run(sctx) })
	}
	r.work.run(sctx)
	res.ProduceSeconds = time.Since(r.start).Seconds()
	wg.Wait()
	if faultErr != nil {
		r.fail("fault: %v", faultErr)
	}
	r.event("production done: %d jobs in %.1fs", r.produced(), res.ProduceSeconds)
	r.drain(sctx, r.streams())
	r.follower.stop()
	r.stopPipelines()
	if sc.judge != nil {
		if err := sc.judge(sctx, r); err != nil {
			r.fail("judge: %v", err)
		}
	}

	res.Jobs = int(r.produced())
	res.Split = r.split()
	res.WriteRetries, res.SendRetries = r.work.writeRetries.Load(), r.work.sendRetries.Load()
	res.WriteMeanMS, res.SendMeanMS = r.work.meanMS()
	streams := r.streams()
	if len(streams) > 1 {
		streams = append(streams, mergeStreams("all", "caughtup", streams...))
	}
	rcfg := env.router.Config()
	for _, st := range streams {
		sr := st.result()
		measureCatchUp(&sr, st, r.follower, &rcfg, r.pausedAll)
		res.Streams = append(res.Streams, sr)
	}
	res.SnapshotsRecorded, res.SnapshotsSkipped = len(r.follower.snaps), r.follower.skipped
	r.follower.snaps = nil
	r.checkCaughtup(&res, res.CapWindowLimit)
	if sc.check != nil {
		sc.check(r, &res)
	}
	env.close()
	r.mu.Lock()
	res.Events, res.Notes = r.events, r.notes
	res.Failures = append(res.Failures, r.failures...)
	r.mu.Unlock()
	return res
}

// rebuildRouter replaces the router newDBEnv built on one pool per standby
// with one on the pools scenario.replicaPools returns, configured as
// newDBEnv configured its own.
func (r *run) rebuildRouter(ctx context.Context, rc consume.Config) error {
	reps, err := r.sc.replicaPools(ctx, r)
	if err != nil {
		return err
	}
	rc.Databases = map[string]replay.Database{"main": {Primary: r.env.primary, Replicas: reps}}
	if rc.Logger == nil {
		rc.Logger = r.s.log
	}
	router, err := consume.NewRouter(ctx, rc)
	if err != nil {
		return err
	}
	_ = r.env.router.Close()
	r.env.router = router
	return nil
}

// streams are the scenario's pipelines: asynq, Kafka in place unless
// asynqOnly, Kafka retry topic with retryTopic, and the adapters' with
// river and kgo.
func (r *run) streams() []*stream {
	out := []*stream{r.ast}
	for _, st := range []*stream{r.kst, r.rst} {
		if st != nil {
			out = append(out, st)
		}
	}
	return append(out, r.adapters.streams()...)
}

// produced counts the jobs of every producer.
func (r *run) produced() int64 {
	n := r.work.produced.Load()
	for _, w := range r.extra {
		n += w.produced.Load()
	}
	return n
}

// split says how the jobs went through the pipelines.
func (r *run) split() string {
	switch {
	case r.adapters != nil:
		return r.splitAdapters()
	case r.kst == nil:
		return fmt.Sprintf("%d asynq", r.ast.jobs())
	case r.rst != nil:
		return fmt.Sprintf("%d asynq + %d kafka in place + %d kafka retry topic, concurrently", r.ast.jobs(), r.kst.jobs(), r.rst.jobs())
	}
	return fmt.Sprintf("%d asynq + %d kafka, concurrently", r.ast.jobs(), r.kst.jobs())
}

func policyName(p consume.Policy) string {
	if p == consume.PolicyDefault {
		return "delayed (default)"
	}
	return p.String()
}

// checkCaughtup applies the acceptance criteria to caughtup's streams:
// no stale read, no lost job, and never more fallback reads on the
// primary in one second than the cap admits.
func (r *run) checkCaughtup(res *scenarioResult, capLimit int) {
	for _, sr := range res.Streams {
		if sr.Stale > 0 {
			r.fail("%s: %d stale reads, e.g. %v", sr.Stream, sr.Stale, sr.StaleExamples)
		}
		if sr.Lost > 0 {
			r.fail("%s: %d of %d jobs never completed (dead-lettered %d), e.g. ids %v", sr.Stream, sr.Lost, sr.Jobs, sr.DeadLetters, sr.LostExamples)
		}
		if sr.RetriedWithoutFailure > 0 {
			r.fail("%s: %d jobs completed with a retry count above 0 without a failed attempt: deferrals grew it", sr.Stream, sr.RetriedWithoutFailure)
		}
		if sr.MaxFallbackPerSec > capLimit {
			r.fail("%s: %d fallback reads on the primary within one second; the cap admits %d", sr.Stream, sr.MaxFallbackPerSec, capLimit)
		}
	}
	r.noteWakes()
	if n := r.ast.leaseExpiredRetries(); n > 0 {
		r.note("asynq retried %d tasks for an expired lease: its recoverer brought back tasks whose state it could not write while Redis was down", n)
	}
	if by, n := r.asynqOverrides(); n > 0 {
		r.note("the asynq middleware overrode %d routing decisions (caughtup.asynq.overrides): %v", n, by)
	}
	if n := int(r.work.produced.Load()); n < r.sl.jobs {
		r.fail("only %d of %d jobs were produced", n, r.sl.jobs)
	}
}

// drain waits until every produced job has completed on every stream, or
// the drain time runs out; after a Redis outage, at least until asynq's
// recoverer has had its chance.
func (r *run) drain(ctx context.Context, streams []*stream) {
	start := time.Now()
	deadline := start.Add(r.sl.drain)
	r.mu.Lock()
	if recovered := r.redisStopped.Add(asynqLeaseRecovery); !r.redisStopped.IsZero() && recovered.After(deadline) {
		deadline = recovered
	}
	r.mu.Unlock()
	last := start
	for {
		left := 0
		for _, st := range streams {
			left += st.pending()
		}
		if left == 0 {
			r.event("every job completed")
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			r.event("gave up waiting: %d jobs not completed after %s", left, time.Since(start).Round(time.Second))
			r.explainUnfinished()
			return
		}
		if time.Since(last) > 10*time.Second {
			r.s.out.say("%s: waiting for %d jobs", r.sc.name, left)
			last = time.Now()
		}
		sleepCtx(ctx, 100*time.Millisecond)
	}
}

func (r *run) startPipelines(ctx context.Context) error {
	s := r.s
	r.asynqClient = asynq.NewClient(s.redisOpt())
	r.inspector = asynq.NewInspector(s.redisOpt())
	// MaxRetry is high because a refusal by the fallback cap counts as a
	// failed attempt (see caughtupasynq.ServerConfig): a task refused on
	// every try of a long lag spike must not reach its last attempt, where
	// the middleware would read the primary past the cap rather than
	// archive it.
	r.asynqPipe = &asynqPipe{queue: r.queue, client: caughtupasynq.NewClient(r.asynqClient), maxRetry: 1000, options: r.sc.taskOptions}
	if _, err := r.startAsynqServer(); err != nil {
		return err
	}
	if err := r.startAdapters(ctx); err != nil {
		return err
	}
	if r.kst == nil {
		return nil
	}
	if err := s.createTopics(ctx, 8, r.topic); err != nil {
		return err
	}
	r.kafkaPipe = s.newKafkaPipe(r.topic)
	if _, err := r.startKafkaMember("kafka-1"); err != nil {
		return err
	}
	if r.rst == nil {
		return nil
	}
	// The retry topic's consumer reads its own topic and topic + ".retry";
	// dead letters go to the hook.
	if err := s.createTopics(ctx, 8, r.retryTopic, r.retryTopic+".retry"); err != nil {
		return err
	}
	r.retryPipe = s.newKafkaPipe(r.retryTopic)
	tune, h := r.kafkaConsumer(r.rst, caughtupkafka.RetryTopic)
	m, err := s.startKafkaMember("kafka-retry-1", r.retryTopic, r.retryTopic, r.rst, tune, r.env.router, h, r.metrics.provider)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.retryMember = m
	r.mu.Unlock()
	return nil
}

func (r *run) startAsynqServer() (*asynq.Server, error) {
	srv, err := r.s.startCaughtupAsynq(r.queue, r.env.router, r.sc.policy, r.ast, r.metrics.provider, r.inspector)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	r.srvs = append(r.srvs, srv)
	r.mu.Unlock()
	return srv, nil
}

// kafkaConsumer is the tuning and handler of a kafka-go member of stream
// st in mode: the handler routes with caughtupkafka.Middleware, or with
// scenario.kafkaRoutes the Consumer routes and the handler reads the pool
// it chose.
func (r *run) kafkaConsumer(st *stream, mode caughtupkafka.Mode) (kafkaTuning, caughtupkafka.Handler) {
	tune := kafkaTuning{retryInitial: 100 * time.Millisecond, retryMax: time.Second, mode: mode}
	if r.sc.kafkaRoutes {
		tune.routes, tune.policy = true, r.sc.policy
		return tune, routedKafkaHandler(st)
	}
	return tune, caughtupKafkaHandler(r.env.router, r.sc.policy, st)
}

func (r *run) startKafkaMember(name string) (*kafkaMember, error) {
	tune, h := r.kafkaConsumer(r.kst, caughtupkafka.InPlace)
	m, err := r.s.startKafkaMember(name, r.topic, r.group, r.kst, tune, r.env.router, h, r.metrics.provider)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	r.members = append(r.members, m)
	r.mu.Unlock()
	return m, nil
}

func (r *run) stopPipelines() {
	r.stopAdapters()
	r.mu.Lock()
	srvs, members := r.srvs, r.members
	if r.retryMember != nil {
		members = append(members, r.retryMember)
	}
	r.srvs, r.members, r.retryMember = nil, nil, nil
	r.mu.Unlock()
	var wg sync.WaitGroup
	for _, srv := range srvs {
		wg.Go(srv.Shutdown)
	}
	for _, m := range members {
		wg.Go(func() {
			if err := m.stop(); err != nil {
				r.fail("%v", err)
			}
		})
	}
	wg.Wait()
	if r.sc.kafkaRoutes && len(members) > 0 {
		r.foldKafkaWaits()
	}
	for _, p := range []*kafkaPipe{r.kafkaPipe, r.retryPipe} {
		if p != nil {
			p.close()
		}
	}
	if r.asynqClient != nil {
		_ = r.asynqClient.Close()
	}
	if r.inspector != nil {
		_ = r.inspector.Close()
		r.inspector = nil
	}
}

// mergeStreams is the union of streams whose job ids do not overlap (the
// lanes of one scenario), for the totals row: the fallback cap is one per
// router, shared by both pipelines.
func mergeStreams(name, policy string, sts ...*stream) *stream {
	out := newStream(name, "", policy)
	for _, st := range sts {
		st.mu.Lock()
		maps.Copy(out.produced, st.produced)
		maps.Copy(out.completed, st.completed)
		maps.Copy(out.tokens, st.tokens)
		maps.Copy(out.attempts, st.attempts)
		maps.Copy(out.failed, st.failed)
		out.reads = append(out.reads, st.reads...)
		out.stale = append(out.stale, st.stale...)
		out.deferrals += st.deferrals
		out.capped += st.capped
		out.errors += st.errors
		out.deadLetters += st.deadLetters
		out.replicaFailed += st.replicaFailed
		st.mu.Unlock()
	}
	return out
}

// asynqLeaseRecovery bounds how long after a Redis outage asynq takes to
// bring back a task whose state change it could not write: the task stays
// active under its lease (30s), the recoverer takes only leases expired
// 30s ago, and it looks once a minute, so up to 2 minutes; then the
// retry's delay and a scheduler tick. asynq's syncer does not shorten
// this: since v0.25 it retries the write with a context its caller has
// already cancelled (hibiken/asynq#926 added the cancel), so every retry
// fails. A Dequeue whose reply the stopping server never sent leaves a
// task in the same state.
const asynqLeaseRecovery = 2*time.Minute + 15*time.Second
