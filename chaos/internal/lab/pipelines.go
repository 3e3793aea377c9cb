package lab

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/fault"
)

const taskType = "chaos:read"

// readRow is the job itself: read the row the producer wrote from the pool
// the routing chose and compare the version with the producer's. A missing
// row or a lower version is a stale read. Errors (a replica killed under
// the read, a primary going away) go back to the queue, which runs the job
// again.
func readRow(ctx context.Context, st *stream, pool *pgxpool.Pool, rd read) error {
	rd.at = time.Now()
	if rd.decided.IsZero() {
		rd.decided = rd.at
	}
	err := pool.QueryRow(ctx, `SELECT version FROM items WHERE id = $1`, rd.job.Key).Scan(&rd.got)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		rd.got = -1
	case err != nil:
		if consume.ReplicaFailed(ctx) {
			st.replicaFailedRun()
		}
		return err
	}
	st.record(rd)
	return nil
}

// caughtupRead is the handler behind caughtup's middleware: the pool and
// the decision come from the context the adapter built. retried is the
// queue's retry count of this run.
func caughtupRead(ctx context.Context, st *stream, p payload, header string, retried int) error {
	return caughtupReadSince(ctx, st, p, header, time.Time{}, retried)
}

// caughtupReadSince is caughtupRead for a job whose token, when header
// carries none, the adapter dated at since: a River job inserted with
// InsertTx, routed by the position after its fetch with its CreatedAt as
// the capture time.
func caughtupReadSince(ctx context.Context, st *stream, p payload, header string, since time.Time, retried int) error {
	dec, ok := consume.DecisionFrom(ctx)
	pool, err := consume.Pool(ctx, "main")
	if !ok || err != nil {
		return errors.New("chaos: the handler's context carries no routing decision")
	}
	rd := read{job: p, outcome: dec.Outcome.String(), reason: dec.Reason.String(), fallback: dec.Fallback, waited: dec.Waited, retried: retried}
	if dd, ok := dec.Database("main"); ok {
		rd.replica = dd.Replica
	}
	if !since.IsZero() && dec.TokenAge > 0 {
		rd.decided = since.Add(dec.TokenAge)
	}
	if tok, err := position.Decode(header); err == nil {
		// The Decision's own clock: Route stamped TokenAge from the same
		// now it decided and charged the fallback cap with.
		if !tok.CapturedAt.IsZero() {
			rd.decided = tok.CapturedAt.Add(dec.TokenAge)
		}
		if len(tok.Entries) > 0 {
			rd.timeline = tok.Entries[0].Epoch.Timeline
		}
	}
	return readRow(ctx, st, pool, rd)
}

// classify counts what a routed attempt that did not complete was.
func classify(st *stream, err error) {
	var de *consume.DeferError
	switch {
	case err == nil:
	case errors.As(err, &de) && de.Refused():
		st.count(0, 1, 0, 0)
	case errors.As(err, &de), errors.Is(err, errRetryThroughQueue):
		st.count(1, 0, 0, 0)
	default:
		st.count(0, 0, 1, 0)
	}
}

// deadlineSlack is what caughtup's asynq middleware adds to a deferral's
// delay before comparing it with the attempt's deadline (asynq rounds
// retry times to whole seconds and moves due tasks every second).
const deadlineSlack = 2 * time.Second

// deferredPastDeadline counts a deferral that outlasts the deadline of the
// attempt that returned it: the case where the middleware must tell an
// asynq.Timeout (per attempt: deferring is safe) from an asynq.Deadline
// (absolute: it would read now instead). The count is keyed by the
// attempt's time limit, which for a Timeout-only task is its Timeout.
func deferredPastDeadline(ctx context.Context, st *stream, began time.Time, err error) {
	var de *consume.DeferError
	dl, ok := ctx.Deadline()
	if !ok || !errors.As(err, &de) || time.Until(dl) >= de.Delay+deadlineSlack {
		return
	}
	st.mu.Lock()
	st.pastDeadline[dl.Sub(began).Round(time.Second)]++
	st.mu.Unlock()
}

// asynqPipe is the producer side of one asynq queue.
type asynqPipe struct {
	queue    string
	client   *caughtupasynq.Client
	maxRetry int
	// options, if set, are extra options of p's task.
	options func(p payload) []asynq.Option
}

// send enqueues through caughtup's stamping client, which reads the token
// of the write from ctx.
func (a *asynqPipe) send(ctx context.Context, p payload) error {
	opts := []asynq.Option{asynq.Queue(a.queue), asynq.MaxRetry(a.maxRetry)}
	if a.options != nil {
		opts = append(opts, a.options(p)...)
	}
	_, err := a.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, taskType, p.encode()), opts...)
	return err
}

// asynqConcurrency is the workers of every asynq server of the suite. A
// task waiting for a replica holds its worker for up to the router's
// WaitBudget (500ms), and under a long lag a deferred task whose delay
// ends first comes back and waits again: through the 30s replay pause the
// asynq pipeline (a third of 250 jobs/s) makes about 400 attempts/s, each
// holding a worker up to 500ms, so about 200 workers are busy waiting
// (Little's law). With fewer, tasks queue up in asynq's pending list
// behind the waiting ones instead of being deferred (and woken at the
// catch-up), and unrelated tasks queue with them. The baselines get as
// many, so that GitLab's in-worker sleeps (up to 1.5s) do not starve them
// of workers either.
const asynqConcurrency = 250

// asynqServerConfig is shared by every asynq server of the suite. A fast
// DelayedTaskCheckInterval keeps deferrals (and baseline retries) close to
// the delay they ask for; TaskCheckInterval keeps an idle queue from adding
// up to a second to each job's latency. Task retries for real errors are
// quick: a killed replica makes reads fail until the tracker notices.
func (s *services) asynqServerConfig(queue string, concurrency int, retry time.Duration) asynq.Config {
	return asynq.Config{
		Concurrency:              concurrency,
		Queues:                   map[string]int{queue: 1},
		DelayedTaskCheckInterval: 200 * time.Millisecond,
		TaskCheckInterval:        20 * time.Millisecond,
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return retry },
		Logger:                   quietAsynq{s.log},
		LogLevel:                 asynq.WarnLevel,
		ShutdownTimeout:          3 * time.Second,
		HealthCheckInterval:      time.Second,
	}
}

func (s *services) redisOpt() asynq.RedisClientOpt {
	return asynq.RedisClientOpt{Addr: s.redis.Addr(), DialTimeout: time.Second, ReadTimeout: 2 * time.Second}
}

// startCaughtupAsynq runs an asynq server with caughtup's hooks and
// middleware; the harness's own middleware outside it counts deferrals.
// The middleware records into mp (nil: the global MeterProvider) and wakes
// deferred tasks through insp, which the caller closes once every server
// using it has shut down and the jobs have completed (the wake then has
// nothing left to do).
func (s *services) startCaughtupAsynq(queue string, router *consume.Router, policy consume.Policy, st *stream, mp metric.MeterProvider, insp *asynq.Inspector) (*asynq.Server, error) {
	cfg := s.asynqServerConfig(queue, asynqConcurrency, 250*time.Millisecond)
	delay := cfg.RetryDelayFunc
	cfg.RetryDelayFunc = func(n int, err error, t *asynq.Task) time.Duration {
		// ServerConfig answers for deferrals itself: what reaches this is a
		// retry asynq counts against the task, after a handler error or
		// for a lease that expired (its recoverer, after a Redis outage),
		// which the handler's wrapper never sees.
		if p, perr := decodePayload(t.Payload()); perr == nil {
			st.attempted(p.ID, err)
		}
		return delay(n, err, t)
	}
	srv := asynq.NewServer(s.redisOpt(), caughtupasynq.ServerConfig(cfg))
	mux := asynq.NewServeMux()
	mux.Use(func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			began := time.Now()
			p, perr := decodePayload(t.Payload())
			if perr == nil {
				st.attempt(p.ID)
			}
			err := next.ProcessTask(ctx, t)
			classify(st, err)
			if perr == nil {
				st.attempted(p.ID, err)
			}
			deferredPastDeadline(ctx, st, began, err)
			return err
		})
	})
	// Redis as well as the Inspector: the wake moves caught-up tasks many
	// per round trip, as under caughtupasynq.NewServer.
	mux.Use(caughtupasynq.Middleware(router, caughtupasynq.MiddlewareConfig{DefaultPolicy: policy, Logger: s.log, MeterProvider: mp, Inspector: insp, Redis: s.redisOpt()}))
	mux.HandleFunc(taskType, func(ctx context.Context, t *asynq.Task) error {
		p, err := decodePayload(t.Payload())
		if err != nil {
			return fmt.Errorf("%w: %v", asynq.SkipRetry, err)
		}
		retried, _ := asynq.GetRetryCount(ctx)
		return caughtupRead(ctx, st, p, t.Headers()[position.HeaderName], retried)
	})
	if err := srv.Start(mux); err != nil {
		return nil, err
	}
	return srv, nil
}

// kafkaPipe is the producer side of one topic.
type kafkaPipe struct {
	topic string
	raw   *kafkago.Writer
	tr    *kafkago.Transport
	w     *caughtupkafka.Writer
}

func (s *services) newKafkaPipe(topic string) *kafkaPipe {
	tr := &kafkago.Transport{}
	raw := &kafkago.Writer{
		Addr:         kafkago.TCP(s.brokers...),
		Topic:        topic,
		Balancer:     &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll,
		BatchTimeout: 2 * time.Millisecond,
		Transport:    tr,
	}
	return &kafkaPipe{topic: topic, raw: raw, tr: tr, w: caughtupkafka.NewWriter(raw)}
}

// send writes through caughtup's stamping writer, keyed by row so that the
// jobs of one row stay in order.
func (k *kafkaPipe) send(ctx context.Context, p payload) error {
	return k.w.WriteMessages(ctx, kafkago.Message{Key: strconv.AppendInt(nil, p.Key, 10), Value: p.encode()})
}

func (k *kafkaPipe) close() {
	_ = k.raw.Close()
	k.tr.CloseIdleConnections()
}

// kafkaMember is one consumer of a group. Its connections go through a
// fault dialer so that it can be killed the way a crashed process dies:
// no final commit, no LeaveGroup, its session left to expire.
type kafkaMember struct {
	name   string
	dialer *fault.Dialer
	cancel context.CancelFunc
	done   chan error
	once   sync.Once

	// handled records when this member's handler completed a message of
	// which partition, so that a scenario can time the coordinator's
	// handovers from what each member actually consumed.
	mu      sync.Mutex
	handled []handledAt
}

type handledAt struct {
	at        time.Time
	partition int
}

// firstAfter is the first message this member completed after t, from
// one of partitions (any partition when nil), and whether there was one.
func (m *kafkaMember) firstAfter(t time.Time, partitions map[int]bool) (time.Time, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, h := range m.handled {
		if h.at.After(t) && (partitions == nil || partitions[h.partition]) {
			return h.at, true
		}
	}
	return time.Time{}, false
}

// partitionsBetween are the partitions this member completed messages of
// in (from, to).
func (m *kafkaMember) partitionsBetween(from, to time.Time) map[int]bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[int]bool{}
	for _, h := range m.handled {
		if h.at.After(from) && h.at.Before(to) {
			out[h.partition] = true
		}
	}
	return out
}

type kafkaTuning struct {
	retryInitial, retryMax time.Duration
	// mode is the Consumer's deferral mode (InPlace by default); a
	// RetryTopic consumer reads topic + ".retry" too, which must exist.
	mode caughtupkafka.Mode
	// routes: the Consumer routes each message with policy before h
	// runs (scenario.kafkaRoutes).
	routes bool
	policy consume.Policy
}

// startKafkaMember starts a consumer whose handler h routes by itself:
// caughtup's with caughtupkafka.Middleware (so that the harness sees every
// deferral on its way back to the Consumer), the baselines with their own
// logic. The Consumer requires a Router; router with consume.Always hands
// every message on at once, without waiting, deferring or touching the
// fallback cap, and h ignores the pool it hands out. With tune.routes
// the Consumer routes with tune.policy instead, and h reads the pool it
// chose (routedKafkaHandler).
func (s *services) startKafkaMember(name, topic, group string, st *stream, tune kafkaTuning, router *consume.Router, h caughtupkafka.Handler, mp metric.MeterProvider) (*kafkaMember, error) {
	m := &kafkaMember{name: name, dialer: fault.NewDialer(nil), done: make(chan error, 1)}
	policy := consume.Always
	if tune.routes {
		policy = tune.policy
	}
	c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
		Brokers:             s.brokers,
		GroupID:             group,
		Topic:               topic,
		Router:              router,
		Policy:              policy,
		Mode:                tune.mode,
		MaxAttempts:         50,
		RetryBackoffInitial: tune.retryInitial,
		RetryBackoffMax:     tune.retryMax,
		CommitInterval:      200 * time.Millisecond,
		HeartbeatInterval:   300 * time.Millisecond,
		SessionTimeout:      s.group.session,
		RebalanceTimeout:    s.group.rebalance,
		JoinGroupBackoff:    200 * time.Millisecond,
		MaxWait:             100 * time.Millisecond,
		Dialer:              &kafkago.Dialer{DialFunc: m.dialer.DialContext, Timeout: 5 * time.Second},
		Logger:              s.log,
		MeterProvider:       mp,
		DeadLetter: func(ctx context.Context, msg kafkago.Message, err error) error {
			// A dead letter is a job that never completed: the
			// checker reports it lost.
			st.count(0, 0, 0, 1)
			s.log.Error("chaos: message dead-lettered", "topic", msg.Topic, "offset", msg.Offset, "error", err)
			return nil
		},
	}, func(ctx context.Context, msg kafkago.Message) error {
		p, perr := decodePayload(msg.Value)
		if perr == nil {
			st.attempt(p.ID)
		}
		err := h(ctx, msg)
		classify(st, err)
		if perr == nil {
			st.attempted(p.ID, err)
		}
		if err == nil {
			m.mu.Lock()
			m.handled = append(m.handled, handledAt{time.Now(), msg.Partition})
			m.mu.Unlock()
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	go func() { m.done <- c.Run(ctx) }()
	return m, nil
}

// caughtupKafkaHandler routes with caughtup's decorator before reading.
func caughtupKafkaHandler(router *consume.Router, policy consume.Policy, st *stream) caughtupkafka.Handler {
	return caughtupkafka.Middleware(router, policy)(func(ctx context.Context, msg kafkago.Message) error {
		p, err := decodePayload(msg.Value)
		if err != nil {
			return nil // not ours; nothing to check
		}
		return caughtupRead(ctx, st, p, tokenText(msg), caughtupkafka.Attempt(ctx))
	})
}

// routedKafkaHandler reads where the Consumer routed the message (a
// kafkaTuning with routes): only routed runs reach it.
func routedKafkaHandler(st *stream) caughtupkafka.Handler {
	return func(ctx context.Context, msg kafkago.Message) error {
		p, err := decodePayload(msg.Value)
		if err != nil {
			return nil // not ours; nothing to check
		}
		return caughtupRead(ctx, st, p, tokenText(msg), caughtupkafka.Attempt(ctx))
	}
}

// foldKafkaWaits adds what the kafka-go Consumers that route by themselves
// (scenario.kafkaRoutes) held in place (waited) or republished to their
// retry topic (deferred), which their handlers never see, to their
// streams' deferrals, once they have stopped and flushed their counts.
func (r *run) foldKafkaWaits() {
	by := r.metrics.sumBy("caughtup.kafka.messages", "messaging.destination.name", "caughtup.kafka.result")
	for _, sp := range []struct {
		st     *stream
		topics []string
	}{{r.kst, []string{r.topic}}, {r.rst, []string{r.retryTopic, r.retryTopic + ".retry"}}} {
		if sp.st == nil {
			continue
		}
		n := int64(0)
		for _, t := range sp.topics {
			n += by[t+"/waited"] + by[t+"/deferred"]
		}
		sp.st.count(int(n), 0, 0, 0)
	}
}

// tokenText is the token msg carries as header text, as the asynq
// pipelines read it from the task's headers: "" when it carries none or
// none that decodes (the harness's producers always stamp one).
func tokenText(msg kafkago.Message) string {
	tok, err := caughtupkafka.TokenOf(msg)
	if err != nil {
		return ""
	}
	s, _ := tok.Encode()
	return s
}

// stop leaves the group cleanly: offsets of finished messages committed.
func (m *kafkaMember) stop() error {
	m.once.Do(m.cancel)
	select {
	case err := <-m.done:
		m.done <- err
		return err
	case <-time.After(30 * time.Second):
		return fmt.Errorf("kafka consumer %s did not stop within 30s", m.name)
	}
}

// kill makes the member vanish as a crashed process would: every
// connection reset and no new one possible, so the last offsets are not
// committed and the group is not told; the coordinator expires the member
// after its session timeout and hands its partitions to the others, which
// redeliver what it had done since its last commit.
func (m *kafkaMember) kill() error {
	m.dialer.Refuse(true)
	m.dialer.Cut()
	return m.stop()
}
