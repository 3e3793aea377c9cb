package main

// The demo: a small "profile update" app on embedded services (a PostgreSQL primary
// with two streaming replicas, Redis, an in-process Kafka broker) that
// writes, enqueues asynq jobs and relays outbox events to Kafka, while a
// lag spike and a failover hit the replicas.
//
// Every request's work is consumed twice over the same traffic and the same
// faults: once through caughtup (the asynq middleware and the Kafka consumer
// routed by a consume.Router) and once by the same handlers reading a
// replica directly, as an app without caughtup would. The final table shows
// the stale reads caughtup prevents.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/outbox"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Options shape one demo run. Zero fields take the defaults.
type Options struct {
	// Out receives the live view and the final table.
	Out io.Writer
	// Live redraws the view in place (for a terminal); otherwise a
	// progress line is printed every few seconds.
	Live bool
	// Duration of the traffic. Default 30s.
	Duration time.Duration
	// Rate of profile updates per second. Default 80.
	Rate int
	// SpikeAt and SpikeFor place the lag spike (replay paused on both
	// replicas). Defaults 5s and 4s.
	SpikeAt, SpikeFor time.Duration
	// FailoverAt is when replica1 is promoted. Default 15s; negative
	// skips the failover.
	FailoverAt time.Duration
	// Logger for the services' own logs; default discards them, since the
	// view is the demo's output.
	Logger *slog.Logger
}

func (o Options) withDefaults() Options {
	if o.Out == nil {
		o.Out = io.Discard
	}
	if o.Duration == 0 {
		o.Duration = 30 * time.Second
	}
	if o.Rate == 0 {
		o.Rate = 80
	}
	if o.SpikeAt == 0 {
		o.SpikeAt = 5 * time.Second
	}
	if o.SpikeFor == 0 {
		o.SpikeFor = 4 * time.Second
	}
	if o.FailoverAt == 0 {
		o.FailoverAt = 15 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Side is what one consumer path saw.
type Side struct {
	Name                    string
	Jobs, Events            int // distinct asynq jobs and Kafka events handled
	Lost                    int // produced but never handled
	Stale                   int // reads older than the version the request wrote
	Runs                    int // handler runs (redeliveries included)
	ReplicaRuns, PrimaryRun int
	Deferred                int64
}

// Result is the run's outcome.
type Result struct {
	Requests  int // requests made
	Committed int // requests whose transaction committed
	Caughtup  Side
	Without   Side
	Failover  bool
	Outcomes  map[string]int64 // by caughtup.outcome name
	Elapsed   time.Duration
	TimelineB uint32 // primary timeline at the end
}

// OK reports the demo's promise: nothing stale or lost through caughtup,
// and stale reads without it (otherwise the demo showed nothing).
func (r Result) OK() bool {
	return r.Caughtup.Stale == 0 && r.Caughtup.Lost == 0 && r.Without.Lost == 0 && r.Without.Stale > 0
}

const (
	users       = 200
	topic       = "profile-events"
	queueFresh  = "caughtup"
	queueDirect = "without"
	taskType    = "profile:sync"
)

// Run runs the demo and returns its result; the view goes to opts.Out.
func Run(ctx context.Context, opts Options) (Result, error) {
	opts = opts.withDefaults()
	start := time.Now()
	fmt.Fprintln(opts.Out, "caughtup demo: starting a primary with 2 streaming replicas, redis-server and an in-process Kafka broker…")

	cluster, err := pgtest.Start(ctx, pgtest.Options{Replicas: 2})
	if err != nil {
		return Result{}, err
	}
	defer cluster.Close()
	redis, err := pgtest.StartRedis(ctx)
	if err != nil {
		return Result{}, err
	}
	defer redis.Close()
	broker, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, topic))
	if err != nil {
		return Result{}, fmt.Errorf("demo: kafka broker: %w", err)
	}
	defer broker.Close()

	a, err := newApp(ctx, cluster, redis.Addr(), broker.ListenAddrs(), opts)
	if err != nil {
		return Result{}, err
	}
	defer a.close()
	fmt.Fprintf(opts.Out, "services up in %s; %d profile updates/s for %s, lag spike at %s for %s, failover at %s\n\n",
		time.Since(start).Round(time.Millisecond), opts.Rate, opts.Duration, opts.SpikeAt, opts.SpikeFor, failoverText(opts.FailoverAt))

	return a.run(ctx, start)
}

func failoverText(d time.Duration) string {
	if d < 0 {
		return "never"
	}
	return d.String()
}

// app is the profile-update app with both consumer paths.
type app struct {
	opts     Options
	cluster  *pgtest.Cluster
	primary  *pgxpool.Pool   // follows the primary across the failover
	replicas []*pgxpool.Pool // one per replica, as an app would configure them
	router   *consume.Router
	reader   *sdkmetric.ManualReader
	mp       *sdkmetric.MeterProvider

	redisOpt asynq.RedisClientOpt
	aclient  *asynq.Client
	client   *caughtupasynq.Client
	servers  []*asynq.Server
	brokers  []string
	writer   *kafkago.Writer

	fresh, direct *tally
	requests      atomic.Int64
	rr            atomic.Uint64
	wg            sync.WaitGroup
}

func newApp(ctx context.Context, c *pgtest.Cluster, redisAddr string, brokers []string, opts Options) (*app, error) {
	a := &app{opts: opts, cluster: c, brokers: brokers, fresh: newTally("with caughtup"), direct: newTally("without")}
	// One connection string over every node, asking for the primary: after
	// the failover, new connections find the promoted node.
	hosts := make([]string, 0, len(c.Nodes()))
	for _, n := range c.Nodes() {
		hosts = append(hosts, "127.0.0.1:"+strconv.Itoa(n.Port()))
	}
	var err error
	a.primary, err = pgxpool.New(ctx, "postgres://postgres@"+strings.Join(hosts, ",")+"/postgres?sslmode=disable&target_session_attrs=primary&connect_timeout=2")
	if err != nil {
		return nil, err
	}
	for _, n := range c.Replicas() {
		p, err := pgxpool.New(ctx, n.DSN("")+"&connect_timeout=2")
		if err != nil {
			a.close()
			return nil, err
		}
		a.replicas = append(a.replicas, p)
	}
	if _, err := a.primary.Exec(ctx, `CREATE TABLE profiles (user_id int PRIMARY KEY, version bigint NOT NULL)`); err != nil {
		a.close()
		return nil, err
	}
	if _, err := a.primary.Exec(ctx, `INSERT INTO profiles SELECT g, 0 FROM generate_series(1, $1) g`, users); err != nil {
		a.close()
		return nil, err
	}
	if err := outbox.Migrate(ctx, a.primary); err != nil {
		a.close()
		return nil, err
	}
	if err := c.WaitReplicasCaughtUp(ctx); err != nil {
		a.close()
		return nil, err
	}

	a.reader = sdkmetric.NewManualReader()
	a.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(a.reader))
	a.router, err = consume.NewRouter(ctx, consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: a.primary, Replicas: replay.Replicas(a.replicas...)}},
		MeterProvider: a.mp,
		Logger:        opts.Logger,
	})
	if err != nil {
		a.close()
		return nil, err
	}
	a.redisOpt = asynq.RedisClientOpt{Addr: redisAddr}
	a.aclient = asynq.NewClient(a.redisOpt)
	a.client = caughtupasynq.NewClient(a.aclient)
	a.writer = &kafkago.Writer{Addr: kafkago.TCP(brokers...), Balancer: &kafkago.Hash{}, RequiredAcks: kafkago.RequireAll, BatchTimeout: 5 * time.Millisecond}
	return a, nil
}

func (a *app) close() {
	for _, s := range a.servers {
		s.Shutdown()
	}
	if a.writer != nil {
		_ = a.writer.Close()
	}
	if a.aclient != nil {
		_ = a.aclient.Close()
	}
	if a.router != nil {
		_ = a.router.Close()
	}
	if a.mp != nil {
		_ = a.mp.Shutdown(context.Background())
	}
	for _, p := range a.replicas {
		p.Close()
	}
	if a.primary != nil {
		a.primary.Close()
	}
}

// profileUpdate is what each job and event carries.
type profileUpdate struct {
	Request int64 `json:"request"`
	User    int   `json:"user"`
	Version int64 `json:"version"`
}

func (a *app) run(ctx context.Context, start time.Time) (Result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if err := a.startConsumers(ctx); err != nil {
		return Result{}, err
	}

	began := time.Now()
	trafficCtx, stopTraffic := context.WithTimeout(ctx, a.opts.Duration)
	defer stopTraffic()
	faultsDone := make(chan error, 1)
	go func() { faultsDone <- a.injectFaults(trafficCtx, began) }()
	viewDone := make(chan struct{})
	viewCtx, stopView := context.WithCancel(ctx)
	go func() { defer close(viewDone); a.view(viewCtx, began) }()

	a.produce(trafficCtx)
	faultErr := <-faultsDone
	// Drain: wait until both paths handled every request or 60s passed.
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		n := int(a.requests.Load())
		if a.fresh.complete(n) && a.direct.complete(n) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	stopView()
	<-viewDone
	cancel()
	a.wg.Wait()

	res := Result{Requests: int(a.requests.Load()), Failover: a.opts.FailoverAt >= 0, Outcomes: a.outcomes(), Elapsed: time.Since(start)}
	res.Committed = a.fresh.committed()
	res.Caughtup = a.fresh.side(res.Requests)
	res.Caughtup.Deferred = res.Outcomes[consume.OutcomeDeferred.String()]
	res.Without = a.direct.side(res.Requests)
	if tl, err := a.cluster.Primary().Timeline(context.Background()); err == nil {
		res.TimelineB = tl
	}
	printFinal(a.opts.Out, res)
	if faultErr != nil {
		return res, fmt.Errorf("demo: fault injection: %w", faultErr)
	}
	return res, nil
}

// produce runs the web requests: each updates a profile and writes an
// outbox event in one transaction, then enqueues a job for each path.
func (a *app) produce(ctx context.Context) {
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(a.opts.Rate))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case <-tick.C:
		}
		id := a.requests.Add(1)
		// A request that fails as a whole (never committed) promises
		// nothing; request records that in both tallies.
		wg.Go(func() { _ = a.request(ctx, id) })
	}
}

func (a *app) request(ctx context.Context, id int64) error {
	user := 1 + rand.IntN(users)
	var upd profileUpdate
	var tctx context.Context
	var err error
	// The failover makes the primary unreachable for a moment; a real app
	// retries the request.
	for attempt := 0; attempt < 50; attempt++ {
		tctx, err = enqueue.InTx(context.WithoutCancel(ctx), a.primary, func(tx pgx.Tx) error {
			upd = profileUpdate{Request: id, User: user}
			if err := tx.QueryRow(ctx, `UPDATE profiles SET version = version + 1 WHERE user_id = $1 RETURNING version`, user).Scan(&upd.Version); err != nil {
				return err
			}
			payload, _ := json.Marshal(upd)
			_, err := outbox.Insert(ctx, tx, outbox.Event{Topic: topic, Key: []byte(strconv.Itoa(user)), Payload: payload})
			return err
		})
		var ce *enqueue.CaptureError
		if err == nil || errors.As(err, &ce) && ce.Committed {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		var ce *enqueue.CaptureError
		if !errors.As(err, &ce) || !ce.Committed {
			a.fresh.expectNone(id)
			a.direct.expectNone(id)
			return err
		}
		// Committed without a token: the job still goes out, and
		// caughtup sends it to the primary.
		tctx = context.WithoutCancel(ctx)
	}
	a.fresh.expect(id, upd.Version)
	a.direct.expect(id, upd.Version)
	payload, _ := json.Marshal(upd)
	for _, q := range []string{queueFresh, queueDirect} {
		for attempt := 0; ; attempt++ {
			_, err := a.client.EnqueueContext(tctx, caughtupasynq.NewTask(tctx, taskType, payload), asynq.Queue(q), asynq.MaxRetry(25))
			if err == nil || attempt == 50 {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return nil
}

func (a *app) startConsumers(ctx context.Context) error {
	// asynq with caughtup: hooks on the server, middleware on the mux.
	fresh := asynq.NewServer(a.redisOpt, caughtupasynq.ServerConfig(asynq.Config{
		Concurrency: 20, Queues: map[string]int{queueFresh: 1}, DelayedTaskCheckInterval: 250 * time.Millisecond,
		Logger: quietLogger{}, LogLevel: asynq.FatalLevel,
	}))
	mux := asynq.NewServeMux()
	mux.Use(caughtupasynq.Middleware(a.router, caughtupasynq.MiddlewareConfig{Redis: a.redisOpt, DefaultPolicy: consume.Delayed, MeterProvider: a.mp, Logger: a.opts.Logger}))
	mux.HandleFunc(taskType, func(ctx context.Context, t *asynq.Task) error {
		return a.handle(ctx, a.fresh, consume.DB(ctx, "main"), t.Payload(), false)
	})
	// The same handler without caughtup: read a replica, as apps do.
	direct := asynq.NewServer(a.redisOpt, asynq.Config{
		Concurrency: 20, Queues: map[string]int{queueDirect: 1}, DelayedTaskCheckInterval: 250 * time.Millisecond,
		Logger: quietLogger{}, LogLevel: asynq.FatalLevel,
	})
	dmux := asynq.NewServeMux()
	dmux.HandleFunc(taskType, func(ctx context.Context, t *asynq.Task) error {
		return a.handle(ctx, a.direct, a.someReplica(), t.Payload(), false)
	})
	for _, s := range []struct {
		srv *asynq.Server
		mux *asynq.ServeMux
	}{{fresh, mux}, {direct, dmux}} {
		if err := s.srv.Start(s.mux); err != nil {
			return fmt.Errorf("demo: asynq server: %w", err)
		}
		a.servers = append(a.servers, s.srv)
	}

	// The outbox relay publishes events stamped with a token.
	pub, err := caughtupkafka.NewOutboxPublisher(a.writer)
	if err != nil {
		return err
	}
	relay, err := outbox.NewPollingRelay(outbox.PollingConfig{Primary: a.primary, Publisher: pub, PollInterval: 20 * time.Millisecond, Logger: a.opts.Logger, MeterProvider: a.mp})
	if err != nil {
		return err
	}
	a.wg.Go(func() { _ = relay.Run(ctx) })

	// Two consumer groups on the same topic: one routed by caughtup, one
	// reading a replica.
	c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
		Brokers: a.brokers, GroupID: "with-caughtup", Topic: topic, Router: a.router, Policy: consume.Delayed,
		MaxWait: 50 * time.Millisecond, CommitInterval: 200 * time.Millisecond, HeartbeatInterval: 500 * time.Millisecond,
		Logger: a.opts.Logger, MeterProvider: a.mp,
	}, func(ctx context.Context, msg kafkago.Message) error {
		return a.handle(ctx, a.fresh, consume.DB(ctx, "main"), msg.Value, true)
	})
	if err != nil {
		return err
	}
	a.wg.Go(func() { _ = c.Run(ctx) })
	a.wg.Go(func() { a.consumeWithout(ctx, topic) })
	return nil
}

// consumeWithout is the same handler without caughtup, on a plain kafka-go
// group reader: it reads any replica, as apps do. A failed read is tried
// again until it succeeds, so that this side loses nothing either.
func (a *app) consumeWithout(ctx context.Context, topic string) {
	r := kafkago.NewReader(kafkago.ReaderConfig{
		Brokers: a.brokers, GroupID: "without", Topic: topic,
		MaxWait: 50 * time.Millisecond, CommitInterval: 200 * time.Millisecond, HeartbeatInterval: 500 * time.Millisecond,
	})
	defer r.Close()
	pause := func() bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(100 * time.Millisecond):
			return true
		}
	}
	for {
		msg, err := r.FetchMessage(ctx)
		if err != nil {
			if !pause() {
				return
			}
			continue
		}
		for a.handle(ctx, a.direct, a.someReplica(), msg.Value, true) != nil {
			if !pause() {
				return
			}
		}
		_ = r.CommitMessages(ctx, msg)
	}
}

// someReplica is how an app without caughtup reads: any replica.
func (a *app) someReplica() *pgxpool.Pool {
	return a.replicas[a.rr.Add(1)%uint64(len(a.replicas))]
}

// handle reads the profile and compares it with the version the request
// wrote: older is a stale read.
func (a *app) handle(ctx context.Context, t *tally, pool *pgxpool.Pool, payload []byte, event bool) error {
	var upd profileUpdate
	if err := json.Unmarshal(payload, &upd); err != nil {
		return fmt.Errorf("demo: bad payload: %w", err)
	}
	var version int64
	if err := pool.QueryRow(ctx, `SELECT version FROM profiles WHERE user_id = $1`, upd.User).Scan(&version); err != nil {
		return err // a real error (a node restarting): the queue retries
	}
	onReplica := true
	if d, ok := consume.DecisionFrom(ctx); ok {
		onReplica = d.Outcome == consume.OutcomeReplica || d.Outcome == consume.OutcomeReplicaWaited
	}
	t.record(upd.Request, event, version < upd.Version, onReplica)
	return nil
}

// injectFaults pauses replay on both replicas (the lag spike) and later
// promotes replica1 (the failover).
func (a *app) injectFaults(ctx context.Context, began time.Time) error {
	sleepUntil := func(at time.Duration) bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(time.Until(began.Add(at))):
			return true
		}
	}
	bg := context.Background()
	if sleepUntil(a.opts.SpikeAt) {
		replicas := a.cluster.Replicas()
		for _, n := range replicas {
			if err := n.PauseReplay(bg); err != nil {
				return err
			}
		}
		sleepUntil(a.opts.SpikeAt + a.opts.SpikeFor)
		for _, n := range replicas {
			if err := n.ResumeReplay(bg); err != nil {
				return err
			}
		}
	}
	if a.opts.FailoverAt >= 0 && sleepUntil(a.opts.FailoverAt) {
		return a.cluster.Promote(bg, a.cluster.Replicas()[0])
	}
	return nil
}

// outcomes sums the router's decisions counter by outcome.
func (a *app) outcomes() map[string]int64 {
	out := map[string]int64{}
	var rm metricdata.ResourceMetrics
	if err := a.reader.Collect(context.Background(), &rm); err != nil {
		return out
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			sum, ok := m.Data.(metricdata.Sum[int64])
			if m.Name != "caughtup.consume.decisions" || !ok {
				continue
			}
			for _, dp := range sum.DataPoints {
				if v, ok := dp.Attributes.Value("caughtup.outcome"); ok {
					out[v.AsString()] += dp.Value
				}
			}
		}
	}
	return out
}

// quietLogger keeps asynq's own logs out of the demo's view.
type quietLogger struct{}

func (quietLogger) Debug(...any) {}
func (quietLogger) Info(...any)  {}
func (quietLogger) Warn(...any)  {}
func (quietLogger) Error(...any) {}
func (quietLogger) Fatal(...any) {}
