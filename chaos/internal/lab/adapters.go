package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/river/caughtupriver"
	"github.com/caughtup/caughtup/testkit/fault"
)

// The River and franz-go pipelines (scenario.river, scenario.kgo): their
// producers write through the workload's lanes like the others, their
// consumers are the adapters' own, and their handlers read through
// caughtupRead, so that the same checker judges them.
//
// River gets two lanes and two streams: "river" inserts each job after
// its write's commit with caughtupriver.Insert (the commit's token in the
// job's metadata), "river-tx" inserts it with River's own InsertTx inside
// the write's transaction (no token: the middleware routes it against the
// primary's position read after the fetch). One River client works both,
// on River's schema in the scenario's database. franz-go gets one lane
// and stream, "kgo": caughtupkgo's Producer stamps each record, its
// Consumer (in place: a waiting record pauses its partition) reads a topic
// of its own.
type adapterPipes struct {
	river *riverPipe
	kgo   *kgoPipe
}

// streams are the adapters' streams, in lane order.
func (a *adapterPipes) streams() []*stream {
	var out []*stream
	if a == nil {
		return out
	}
	if a.river != nil {
		out = append(out, a.river.st, a.river.txst)
	}
	if a.kgo != nil {
		out = append(out, a.kgo.st)
	}
	return out
}

// lanes are where the adapters' share of the jobs goes.
func (a *adapterPipes) lanes() []*lane {
	var out []*lane
	if a == nil {
		return out
	}
	if a.river != nil {
		out = append(out,
			&lane{name: "river", sinks: []sink{{send: a.river.send, streams: []*stream{a.river.st}}}},
			&lane{name: "river-tx", sinks: []sink{{sendTx: a.river.sendTx, streams: []*stream{a.river.txst}}}})
	}
	if a.kgo != nil {
		out = append(out, &lane{name: "kgo", sinks: []sink{{send: a.kgo.send, streams: []*stream{a.kgo.st}}}})
	}
	return out
}

// startAdapters starts the pipelines the scenario asks for.
func (r *run) startAdapters(ctx context.Context) error {
	if !r.sc.river && !r.sc.kgo {
		return nil
	}
	a := &adapterPipes{}
	r.mu.Lock()
	r.adapters = a
	r.mu.Unlock()
	if r.sc.river {
		rp, err := r.startRiver(ctx)
		if rp != nil {
			a.river = rp
		}
		if err != nil {
			return fmt.Errorf("river: %w", err)
		}
	}
	if r.sc.kgo {
		kp, err := r.startKgo(ctx)
		if kp != nil {
			a.kgo = kp
		}
		if err != nil {
			return fmt.Errorf("franz-go: %w", err)
		}
	}
	return nil
}

// stopAdapters stops the adapters' consumers and closes their producers;
// the franz-go consumer's in-place waits, which its handler never sees,
// are then added to its stream's deferrals from the consumer's counter.
func (r *run) stopAdapters() {
	r.mu.Lock()
	a := r.adapters
	r.mu.Unlock()
	if a == nil {
		return
	}
	if a.river != nil {
		if err := a.river.stop(); err != nil {
			r.fail("river: %v", err)
		}
	}
	if a.kgo != nil {
		if err := a.kgo.stop(); err != nil {
			r.fail("franz-go: %v", err)
		}
		a.kgo.foldWaits(r.metrics)
	}
}

// splitAdapters is split for a scenario with the adapters' pipelines.
func (r *run) splitAdapters() string {
	s := fmt.Sprintf("%d asynq", r.ast.jobs())
	if r.kst != nil {
		s += fmt.Sprintf(" + %d kafka in place", r.kst.jobs())
	}
	if r.rst != nil {
		s += fmt.Sprintf(" + %d kafka retry topic", r.rst.jobs())
	}
	if rp := r.adapters.river; rp != nil {
		s += fmt.Sprintf(" + %d river (Insert, metadata token) + %d river-tx (InsertTx, position after the fetch)", rp.st.jobs(), rp.txst.jobs())
	}
	if kp := r.adapters.kgo; kp != nil {
		s += fmt.Sprintf(" + %d kgo (franz-go, in place)", kp.st.jobs())
	}
	return s + ", concurrently"
}

// riverKind is the River job kind of the lab's jobs.
const riverKind = "chaos_read"

// riverArgs is a River job: the payload every pipeline carries, and
// whether it was inserted in its write's transaction.
type riverArgs struct {
	payload
	Tx bool `json:"tx,omitempty"`
}

func (riverArgs) Kind() string { return riverKind }

// riverWorkers is the River client's MaxWorkers. As for asynq
// (asynqConcurrency), a job waiting for a replica holds its worker for up
// to the router's WaitBudget (500ms), and a snoozed job comes back and may
// wait again: River's share of the jobs (a third of a scenario's
// 250-300 jobs/s at most) keeps up to about 100 workers waiting when every
// replica is behind.
const riverWorkers = 150

// riverRetry is the delay before River runs a failed job again. River's
// default (attempt^4 seconds) would put a job that failed a few times
// behind the drain; a refusal by the fallback cap, a killed replica under
// a read, are what fails a job here, and both pass quickly.
const riverRetry = 250 * time.Millisecond

type fixedRetry time.Duration

func (f fixedRetry) NextRetry(*rivertype.JobRow) time.Time { return time.Now().Add(time.Duration(f)) }

// riverPipe is River's producer (the client's inserts) and worker.
type riverPipe struct {
	pool     *pgxpool.Pool
	client   *river.Client[pgx.Tx]
	st, txst *stream
	started  bool
}

func (p *riverPipe) stream(tx bool) *stream {
	if tx {
		return p.txst
	}
	return p.st
}

// startRiver installs River's schema in the scenario's database and
// starts a client working it with caughtup's middleware. The client has a
// pool of its own on the primary (the producers' DSN, so it follows a
// promotion as they do).
func (r *run) startRiver(ctx context.Context) (*riverPipe, error) {
	rp := &riverPipe{st: newStream("river", "river", "caughtup"), txst: newStream("river-tx", "river", "caughtup")}
	dsn, hook := primaryDSN(r.cluster, r.env.name), (func(context.Context, *pgx.ConnConfig) error)(nil)
	if r.sc.movablePrimary {
		dsn = movableDSN(r.cluster, r.env.name)
		hook = func(_ context.Context, cc *pgx.ConnConfig) error {
			cc.Port = uint16(r.env.target.Load())
			return nil
		}
	}
	var err error
	if rp.pool, err = newPrimaryPool(ctx, dsn, 20, "chaos-river", hook); err != nil {
		return nil, err
	}
	m, err := rivermigrate.New(riverpgxv5.New(rp.pool), nil)
	if err != nil {
		return rp, err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return rp, fmt.Errorf("migrate River's schema: %w", err)
	}
	mw, err := caughtupriver.NewMiddleware(r.env.router, caughtupriver.Config{
		DefaultPolicy: r.sc.policy, MeterProvider: r.metrics.provider, Logger: r.s.log,
	})
	if err != nil {
		return rp, err
	}
	rp.client, err = newRiverClient(rp.pool, river.QueueDefault, riverWorkers, riverRetry, r.s.log,
		func(ctx context.Context, job *river.Job[riverArgs]) error {
			// River counts Attempt from 1 and restores it after a snooze: a
			// run after no failed attempt is attempt 1.
			return caughtupReadSince(ctx, rp.stream(job.Args.Tx), job.Args.payload, riverTokenText(job.JobRow), job.CreatedAt, job.Attempt-1)
		},
		riverCounting(func(a riverArgs) *stream { return rp.stream(a.Tx) }), mw)
	if err != nil {
		return rp, err
	}
	if err := rp.client.Start(context.WithoutCancel(ctx)); err != nil {
		return rp, err
	}
	rp.started = true
	return rp, nil
}

// riverCounting is middleware that counts, for the stream of each job's
// args, every attempt: snoozes as deferrals (River gives their attempt
// back), the rest as classify does. Outside caughtup's middleware, as the
// asynq and Kafka pipelines' wrappers are: it sees every attempt, snoozes
// and refusals included.
func riverCounting(streamOf func(riverArgs) *stream) rivertype.Middleware {
	return river.WorkerMiddlewareFunc(func(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
		var a riverArgs
		if err := json.Unmarshal(job.EncodedArgs, &a); err != nil {
			return doInner(ctx)
		}
		st := streamOf(a)
		st.attempt(a.ID)
		err := doInner(ctx)
		var snooze *rivertype.JobSnoozeError
		if errors.As(err, &snooze) {
			// A deferral: River restores the attempt.
			st.count(1, 0, 0, 0)
			return err
		}
		classify(st, err)
		st.attempted(a.ID, err)
		return err
	})
}

// newRiverClient starts a River client on pool working queue with
// workers workers, retrying a failed job after retry, up to 1,000
// attempts (as asynq's maxRetry: a refusal by the fallback cap is a failed
// attempt, and a job must not reach its last one during a long lag spike,
// when the middleware would hold it in its worker), with work as the lab
// job's worker and middleware in order.
func newRiverClient(pool *pgxpool.Pool, queue string, workers int, retry time.Duration, log *slog.Logger,
	work func(context.Context, *river.Job[riverArgs]) error, middleware ...rivertype.Middleware) (*river.Client[pgx.Tx], error) {
	ws := river.NewWorkers()
	river.AddWorker(ws, river.WorkFunc(work))
	return river.NewClient(riverpgxv5.New(pool), &river.Config{
		Queues:            map[string]river.QueueConfig{queue: {MaxWorkers: workers}},
		Workers:           ws,
		Middleware:        middleware,
		FetchCooldown:     20 * time.Millisecond,
		FetchPollInterval: 100 * time.Millisecond,
		MaxAttempts:       1000,
		RetryPolicy:       fixedRetry(retry),
		Logger:            log,
	})
}

// riverTokenText is the token in job's metadata as header text, "" when
// it has none (InsertTx) or none that decodes.
func riverTokenText(job *rivertype.JobRow) string {
	tok, ok, err := caughtupriver.TokenOf(job)
	if !ok || err != nil {
		return ""
	}
	s, _ := tok.Encode()
	return s
}

// send inserts after the commit with the token ctx carries.
func (p *riverPipe) send(ctx context.Context, pl payload) error {
	_, err := caughtupriver.Insert(ctx, p.client, riverArgs{payload: pl}, nil)
	return err
}

// sendTx inserts in the write's transaction, as River recommends.
func (p *riverPipe) sendTx(ctx context.Context, tx pgx.Tx, pl payload) error {
	_, err := p.client.InsertTx(ctx, tx, riverArgs{payload: pl, Tx: true}, nil)
	return err
}

func (p *riverPipe) stop() error {
	var err error
	if p.started {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err = p.client.Stop(ctx); err != nil {
			err = fmt.Errorf("the River client did not stop within 30s: %w", err)
		}
		p.started = false
	}
	if p.pool != nil {
		p.pool.Close()
		p.pool = nil
	}
	return err
}

// kgoPipe is franz-go's producer and the consumers of its group, on a
// topic of their own.
type kgoPipe struct {
	topic  string
	prod   *kgo.Client
	p      *caughtupkgo.Producer
	st     *stream
	folded bool

	mu      sync.Mutex
	members []*kgoMember
}

// kgoMember is one caughtupkgo.Consumer of the group. Its connections go
// through a fault dialer, so that it can be killed as a crashed process
// dies (as kafkaMember).
type kgoMember struct {
	name    string
	dialer  *fault.Dialer
	cancel  context.CancelFunc
	done    chan error
	handled atomic.Int64 // records its handler completed
	once    sync.Once
	err     error
}

// startKgo creates the topic (8 partitions, as the kafka-go pipelines'),
// its producer and a first consumer of the group named after the topic.
func (r *run) startKgo(ctx context.Context) (*kgoPipe, error) {
	kp := &kgoPipe{topic: r.s.name(r.sc.name + "-kgo"), st: newStream("kgo", "kafka", "caughtup")}
	if err := r.s.createTopics(ctx, 8, kp.topic); err != nil {
		return nil, err
	}
	var err error
	kp.prod, err = kgo.NewClient(kgo.SeedBrokers(r.s.brokers...), kgo.DefaultProduceTopic(kp.topic), kgo.ProducerLinger(2*time.Millisecond))
	if err != nil {
		return nil, err
	}
	kp.p = caughtupkgo.NewProducer(kp.prod)
	_, err = kp.startMember(r, "kgo-1")
	return kp, err
}

// startMember starts a consumer of the group, with the suite's group
// timings.
func (k *kgoPipe) startMember(r *run, name string) (*kgoMember, error) {
	m := &kgoMember{name: name, dialer: fault.NewDialer(nil), done: make(chan error, 1)}
	st := k.st
	c, err := caughtupkgo.NewConsumer(caughtupkgo.ConsumerConfig{
		ClientOpts: []kgo.Opt{
			kgo.SeedBrokers(r.s.brokers...),
			kgo.Dialer(m.dialer.DialContext),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
			kgo.FetchMaxWait(100 * time.Millisecond),
			kgo.SessionTimeout(r.s.group.session),
			kgo.RebalanceTimeout(r.s.group.rebalance),
			kgo.HeartbeatInterval(300 * time.Millisecond),
		},
		GroupID:             k.topic,
		Topic:               k.topic,
		Router:              r.env.router,
		Policy:              r.sc.policy,
		Mode:                caughtupkgo.InPlace,
		MaxAttempts:         50,
		RetryBackoffInitial: 100 * time.Millisecond,
		RetryBackoffMax:     time.Second,
		CommitInterval:      200 * time.Millisecond,
		Logger:              r.s.log,
		MeterProvider:       r.metrics.provider,
		DeadLetter: func(ctx context.Context, rec *kgo.Record, err error) error {
			// Never completed: the checker reports it lost.
			st.count(0, 0, 0, 1)
			r.s.log.Error("chaos: record dead-lettered", "topic", rec.Topic, "offset", rec.Offset, "error", err)
			return nil
		},
	}, func(ctx context.Context, rec *kgo.Record) error {
		p, err := decodePayload(rec.Value)
		if err != nil {
			return nil // not ours; nothing to check
		}
		// Only routed attempts reach the handler: the Consumer routes
		// before it, and holds a record that must wait (foldWaits).
		st.attempt(p.ID)
		err = caughtupRead(ctx, st, p, kgoTokenText(rec), caughtupkgo.Attempt(ctx))
		classify(st, err)
		st.attempted(p.ID, err)
		if err == nil {
			m.handled.Add(1)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	go func() { m.done <- c.Run(cctx) }()
	k.mu.Lock()
	k.members = append(k.members, m)
	k.mu.Unlock()
	return m, nil
}

// stop ends the member's Run: it commits what is done and leaves the
// group, unless it was killed.
func (m *kgoMember) stop() error {
	m.once.Do(func() {
		m.cancel()
		select {
		case err := <-m.done:
			if err != nil {
				m.err = fmt.Errorf("franz-go consumer %s: %w", m.name, err)
			}
		case <-time.After(30 * time.Second):
			m.err = fmt.Errorf("franz-go consumer %s did not stop within 30s", m.name)
		}
	})
	return m.err
}

// kill makes the member vanish as a crashed process would: connections
// reset and refused, so its last offsets are not committed and the group
// is not told; the coordinator expires it after its session timeout and
// hands its partitions to the others, which deliver again what it had
// done since its last commit.
func (m *kgoMember) kill() error {
	m.dialer.Refuse(true)
	m.dialer.Cut()
	return m.stop()
}

// kgoTokenText is the token rec carries as header text ("" for none).
func kgoTokenText(rec *kgo.Record) string {
	tok, err := caughtupkgo.TokenOf(rec)
	if err != nil {
		return ""
	}
	s, _ := tok.Encode()
	return s
}

// send produces through caughtup's stamping Producer, keyed by row so that
// the jobs of one row stay in order.
func (k *kgoPipe) send(ctx context.Context, p payload) error {
	return k.p.ProduceSync(ctx, &kgo.Record{Key: strconv.AppendInt(nil, p.Key, 10), Value: p.encode()}).FirstErr()
}

// stop stops every member and closes the producer.
func (k *kgoPipe) stop() error {
	k.mu.Lock()
	members := k.members
	k.members = nil
	k.mu.Unlock()
	var errs []error
	for _, m := range members {
		errs = append(errs, m.stop())
	}
	if k.prod != nil {
		k.prod.Close()
		k.prod = nil
	}
	return errors.Join(errs...)
}

// foldWaits adds the consumer's in-place waits (caughtup.kafka.messages
// waited: each a Route that returned a deferral, the cap's refusals
// among them) to the stream's deferrals, once the consumer has stopped
// and flushed its counts.
func (k *kgoPipe) foldWaits(m *runMetrics) {
	if k.folded {
		return
	}
	k.folded = true
	by := m.sumBy("caughtup.kafka.messages", "messaging.destination.name", "caughtup.kafka.result")
	k.st.count(int(by[k.topic+"/waited"]), 0, 0, 0)
}

// riverTokens are the River middleware's tokens by source
// (caughtup.river.tokens: metadata, fetch, ...).
func (r *run) riverTokens() map[string]int64 {
	return r.metrics.sum("caughtup.river.tokens", "caughtup.river.token")
}

// noteRiverWake notes what the River middleware's waker did: snoozed jobs
// made available at their catch-up, attempts that moved none (by
// error.type) and jobs forgotten first (by reason).
func (r *run) noteRiverWake() {
	r.note("river wake: %d snoozed jobs made available at their catch-up; attempts that moved none, by error.type: %v; forgotten first: %v",
		r.metrics.sum("caughtup.river.wake.jobs", "")[""], r.metrics.sum("caughtup.river.wake.errors", "error.type"),
		r.metrics.sum("caughtup.river.wake.dropped", "caughtup.river.wake.reason"))
}

var _ rivertype.WorkerMiddleware = river.WorkerMiddlewareFunc(nil)

// laneNames lists the lanes' names.
func laneNames(lanes []*lane) string {
	s := ""
	for i, l := range lanes {
		if i > 0 {
			s += ", "
		}
		s += l.name
	}
	return s
}

func adaptersScenario(sl scale) *scenario {
	maxPause, _ := pauses(sl)
	return &scenario{
		name: "adapters",
		about: fmt.Sprintf("every pipeline at once: asynq, kafka-go in place and retry topic, River (caughtupriver.Insert with the commit's token, "+
			"and InsertTx in the write's transaction) and franz-go (caughtupkgo, in place); replay paused at random (up to %s, one replica or both) "+
			"throughout, while replica1 and then replica2 are SIGKILLed and restarted %s later; a franz-go member killed (no commit, no leave), "+
			"a replacement, a third joining (rebalance)", maxPause, sl.down),
		policy:     consume.Delayed,
		retryTopic: true,
		river:      true,
		kgo:        true,
		span:       func(s scale) time.Duration { return s.span(s.lead + 3*s.down + s.down/2 + s.tail) },
		fault:      adaptersFault,
		check:      checkAdapters,
	}
}

// adaptersFault pauses replay at random from the lead (startPauser), and
// meanwhile SIGKILLs each replica in turn, half a down time apart, and
// restarts it after the down time. The pauser is held around each kill and
// restart, so that it never pauses or resumes a node that is going away
// or coming back.
func adaptersFault(ctx context.Context, r *run) error {
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	maxPause, maxGap := pauses(r.sl)
	p := startPauser(r, maxPause, maxGap)
	r.event("random replay pauses started (up to %s, rests up to %s)", maxPause, maxGap)
	defer func() {
		p.stop()
		r.event("random replay pauses stopped: %s", p)
		if n := p.errs.Load(); n > 0 {
			r.fail("the pauser failed to pause or resume replay %d times", n)
		}
	}()
	churn := make(chan error, 1)
	go func() { churn <- kgoChurn(ctx, r) }()
	defer func() {
		if err := <-churn; err != nil {
			r.fail("franz-go consumers: %v", err)
		}
	}()
	t, err := crashReplicas(ctx, r, r.sl.lead+r.sl.down/2, func(op func() error) error {
		p.hold()
		defer p.release()
		return op()
	})
	if err != nil {
		return err
	}
	return r.at(ctx, t+r.sl.down/2)
}

// kgoChurn kills the franz-go group's first member a down time after the
// lead and starts a replacement, and 1.5 down times later adds a third
// member (a rebalance), while the replicas crash and pause.
func kgoChurn(ctx context.Context, r *run) error {
	k := r.adapters.kgo
	k.mu.Lock()
	first := k.members[0]
	k.mu.Unlock()
	if err := r.at(ctx, r.sl.lead+r.sl.down); err != nil {
		return err
	}
	err := first.kill()
	k.mu.Lock()
	k.members = slices.DeleteFunc(k.members, func(m *kgoMember) bool { return m == first })
	k.mu.Unlock()
	if err != nil {
		return err
	}
	r.event("kgo: killed %s (connections reset and refused: no final commit, no LeaveGroup); it had completed %d records", first.name, first.handled.Load())
	second, err := k.startMember(r, "kgo-2")
	if err != nil {
		return err
	}
	r.event("kgo: kgo-2 joined the group; it gets kgo-1's partitions once kgo-1's session (%s) expires", r.s.group.session)
	if err := r.at(ctx, r.sl.lead+5*r.sl.down/2); err != nil {
		return err
	}
	third, err := k.startMember(r, "kgo-3")
	if err != nil {
		return err
	}
	r.event("kgo: kgo-3 joined: rebalance")
	r.mu.Lock()
	r.state = &kgoChurnState{members: []*kgoMember{first, second, third}}
	r.mu.Unlock()
	return nil
}

type kgoChurnState struct{ members []*kgoMember }

// checkAdapters: the crashes were noticed (checkCrash), and both of
// River's token paths and every pipeline were exercised: River routed
// jobs by their metadata token and by the position after the fetch, and
// each stream has jobs.
func checkAdapters(r *run, res *scenarioResult) {
	checkCrash(r, res)
	toks := r.riverTokens()
	r.note("river middleware tokens by source (caughtup.river.tokens): %v", toks)
	r.noteRiverWake()
	if toks["metadata"] == 0 {
		r.fail("no River job was routed by a metadata token: the caughtupriver.Insert path was not exercised")
	}
	if toks["fetch"] == 0 {
		r.fail("no River job was routed by the position after its fetch: the InsertTx path was not exercised")
	}
	waited := 0
	for _, sr := range res.Streams[:len(res.Streams)-1] {
		if sr.Jobs == 0 {
			r.fail("%s: no job went through it", sr.Stream)
		}
		w := sr.Outcomes[consume.OutcomeReplicaWaited.String()]
		r.note("%s: %d runs for %d jobs, %d after a wait for a replica, %d deferrals", sr.Stream, sr.Runs, sr.Jobs, w, sr.Deferrals)
		waited += w + sr.Deferrals
	}
	if waited == 0 {
		r.fail("no job waited for a replica or was deferred: the pauses did not take effect")
	}
	r.mu.Lock()
	cs, _ := r.state.(*kgoChurnState)
	r.mu.Unlock()
	if cs == nil {
		return // the fault failed and said so
	}
	var by []string
	for _, m := range cs.members {
		by = append(by, fmt.Sprintf("%s %d", m.name, m.handled.Load()))
		if m.handled.Load() == 0 {
			r.fail("franz-go consumer %s completed no record: the group never gave it partitions", m.name)
		}
	}
	for _, sr := range res.Streams {
		if sr.Stream == "kgo" {
			r.note("kgo: records completed by member: %s (%d runs for %d jobs: %d delivered again after the kill and the rebalance)",
				strings.Join(by, ", "), sr.Runs, sr.Jobs, sr.Runs-sr.Completed)
		}
	}
}

func adaptersPauseScenario(sl scale) *scenario {
	return &scenario{
		name: "adapters-pause",
		about: fmt.Sprintf("WAL replay paused on both replicas for %s mid-run, with every pipeline at once (as adapters): River's jobs snoozed "+
			"again and again, franz-go's partitions paused, through one long lag", sl.pause),
		policy:     consume.Delayed,
		retryTopic: true,
		river:      true,
		kgo:        true,
		span:       func(s scale) time.Duration { return s.span(s.lead + s.pause + s.tail) },
		fault:      replayPause,
		check:      checkAdaptersPause,
	}
}

// checkAdaptersPause: every pipeline deferred jobs through the pause (a
// River snooze, an in-place wait, an asynq deferral, a retry-topic
// republish), and River routed by both kinds of token.
func checkAdaptersPause(r *run, res *scenarioResult) {
	toks := r.riverTokens()
	r.note("river middleware tokens by source (caughtup.river.tokens): %v", toks)
	r.noteRiverWake()
	if toks["metadata"] == 0 || toks["fetch"] == 0 {
		r.fail("River routed jobs by %d metadata tokens and %d positions after the fetch: both paths must be exercised", toks["metadata"], toks["fetch"])
	}
	for _, sr := range res.Streams[:len(res.Streams)-1] {
		if sr.Deferrals == 0 {
			r.fail("%s: no job was deferred: the pause did not reach it", sr.Stream)
		}
	}
}
