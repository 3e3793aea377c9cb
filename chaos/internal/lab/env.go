package lab

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// services are the real servers every scenario runs on: one replicated
// PostgreSQL cluster (scenarios that promote a replica start their own),
// one redis-server and one Apache Kafka broker (or the cluster
// $KAFKA_BROKERS names).
type services struct {
	opts    options
	cluster *pgtest.Cluster
	redis   *pgtest.Redis
	kafka   *kafkatest.Broker
	brokers []string
	// group are the consumer-group timings every Kafka member of the
	// suite uses (see kafkaGroupTimings).
	group groupTimings
	// tag is this run's part of queue, topic and group names: an external
	// Kafka cluster keeps the topics of earlier runs, and two runs may
	// share it.
	tag string
	log *slog.Logger
	out *progress
	// feed runs the feed scenarios' publisher processes.
	feed feedTools
}

// groupTimings are a consumer group's session and rebalance timeouts.
type groupTimings struct {
	session, rebalance time.Duration
}

// kafkaGroupTimings: a member killed without leaving is expired after its
// session timeout, and only then do the others get its partitions, so the
// suite wants a short one: 3s, ten heartbeats of 300ms. A Kafka broker
// refuses sessions below group.min.session.timeout.ms (6s by default),
// which the suite's own broker lowers to 1s (brokerSettings). An external
// cluster ($KAFKA_BROKERS) keeps its own minimum, so the suite uses 10s
// there. The rebalance timeout is how long the coordinator waits for every
// live member to rejoin: 6s leaves room for a member whose partitions are
// mid-deferral on a starved 2-core machine; a dead member is expired by
// its session first.
func kafkaGroupTimings(external bool) groupTimings {
	if external {
		return groupTimings{session: 10 * time.Second, rebalance: 10 * time.Second}
	}
	return groupTimings{session: 3 * time.Second, rebalance: 6 * time.Second}
}

// brokerSettings are the suite's changes to testkit/kafkatest's broker:
// sessions as short as the consumer kills need (see kafkaGroupTimings).
var brokerSettings = map[string]string{"group.min.session.timeout.ms": "1000"}

// clusterOptions are the settings of every cluster the suite starts.
// max_standby_streaming_delay bounds the replay-conflict scenario's stall;
// the short run shortens it so that the conflict is resolved by the server
// within the run, as the full run's 30s default is.
// pgtest's own messages (promotions, re-pointed or rebuilt standbys) go to
// the progress output.
func clusterOptions(o options, out *progress) pgtest.Options {
	return pgtest.Options{
		Logf:     func(format string, args ...any) { out.say(format, args...) },
		Replicas: 2,
		Settings: map[string]string{
			"max_standby_streaming_delay": fmt.Sprintf("%dms", o.scale.standbyDelay.Milliseconds()),
		},
	}
}

func startServices(ctx context.Context, o options, out *progress, logw io.Writer) (*services, error) {
	s := &services{opts: o, out: out, tag: runTag()}
	s.feed.given = o.caughtupBin
	s.log = slog.New(slog.NewTextHandler(logw, &slog.HandlerOptions{Level: slog.LevelWarn}))
	// go-redis logs each connection a Redis restart breaks; expected here.
	redis.SetLogger(redisLog{s.log})
	began := time.Now()
	out.say("starting PostgreSQL (primary + 2 streaming replicas), redis-server and a Kafka broker")
	// The broker's JVM takes seconds to start (many more on a loaded
	// machine): it starts while PostgreSQL and Redis do.
	kafkaUp := make(chan error, 1)
	go func() {
		b, err := kafkatest.Start(ctx, kafkatest.Options{Settings: brokerSettings})
		s.kafka = b
		kafkaUp <- err
	}()
	err := s.startPostgresRedis(ctx, o)
	if kerr := <-kafkaUp; kerr != nil {
		err = errors.Join(err, fmt.Errorf("start Kafka: %w", kerr))
	}
	if err != nil {
		s.close()
		return nil, err
	}
	s.brokers = s.kafka.Brokers()
	s.group = kafkaGroupTimings(s.kafka.External())
	// The consumers scenario kills a member, then adds one 1x its spacing
	// later and removes it 3x later; the added member gets partitions
	// only once the dead one's session has expired, so the spacing must
	// be well over a third of the session: half of it.
	s.opts.scale.consumers = max(s.opts.scale.consumers, s.group.session/2)
	where := "a single-node Apache Kafka broker (testkit/kafkatest)"
	if s.kafka.External() {
		where = "the Kafka cluster in $KAFKA_BROKERS"
	}
	out.say("services up in %s; Kafka: %s at %s", time.Since(began).Round(100*time.Millisecond), where, strings.Join(s.brokers, ","))
	return s, nil
}

func (s *services) startPostgresRedis(ctx context.Context, o options) error {
	var err error
	if s.cluster, err = pgtest.Start(ctx, clusterOptions(o, s.out)); err != nil {
		return fmt.Errorf("start PostgreSQL cluster: %w", err)
	}
	if s.redis, err = pgtest.StartRedis(ctx); err != nil {
		return fmt.Errorf("start redis-server: %w", err)
	}
	return s.redisPersistence(ctx)
}

// runTag is 8 random hex digits.
func runTag() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

var runSeq atomic.Int64

// name is a queue, topic and consumer-group name of this run, unique in
// the process and, through tag, across runs sharing a Redis or a Kafka
// cluster.
func (s *services) name(what string) string {
	return fmt.Sprintf("chaos-%s-%s-%d", s.tag, what, runSeq.Add(1))
}

// kafkaName says which Kafka the suite ran against, for the results.
func (s *services) kafkaName() string {
	if s.kafka == nil {
		return ""
	}
	if s.kafka.External() {
		return "external ($KAFKA_BROKERS=" + strings.Join(s.brokers, ",") + ")"
	}
	return "Apache Kafka broker from testkit/kafkatest (single-node KRaft)"
}

func (s *services) close() {
	_ = s.feed.close()
	if s.kafka != nil {
		_ = s.kafka.Close()
	}
	if s.redis != nil {
		_ = s.redis.Close()
	}
	if s.cluster != nil {
		_ = s.cluster.Close()
	}
}

// redisPersistence makes a restart of redis-server keep its data.
// pgtest starts redis-server with --save "" --appendonly no and has no
// option to change that, so the settings are applied at runtime and again
// after every Start. A save point makes the SIGTERM of Redis.Stop write
// dump.rdb before exiting, and the restarted server loads it from its
// unchanged --dir; appendonly/appendfsync always make every write durable
// as it happens, but pgtest's command line (--appendonly no) means a
// restarted server reads the RDB, not the AOF. So a clean Stop/Start loses
// nothing, while a SIGKILL (Redis.Kill) would lose what came after the
// last snapshot: the suite only uses Stop.
func (s *services) redisPersistence(ctx context.Context) error {
	c := redis.NewClient(&redis.Options{Addr: s.redis.Addr()})
	defer c.Close()
	for _, kv := range [][2]string{{"save", "3600 1"}, {"appendonly", "yes"}, {"appendfsync", "always"}} {
		if err := c.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			return fmt.Errorf("redis CONFIG SET %s %s: %w", kv[0], kv[1], err)
		}
	}
	return nil
}

// redisKeysLoaded is how many keys the running redis-server loaded from
// disk when it started (-1 if unknown): the evidence that a restart kept
// the queues.
func (s *services) redisKeysLoaded(ctx context.Context) int64 {
	c := redis.NewClient(&redis.Options{Addr: s.redis.Addr()})
	defer c.Close()
	info, err := c.Info(ctx, "persistence").Result()
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "rdb_last_load_keys_loaded:"); ok {
			if n, err := strconv.ParseInt(v, 10, 64); err == nil {
				return n
			}
		}
	}
	return -1
}

// createTopics makes topics of n partitions and waits until each
// partition has a leader.
func (s *services) createTopics(ctx context.Context, n int, names ...string) error {
	for _, name := range names {
		if err := s.kafka.CreateTopic(ctx, name, n); err != nil {
			return fmt.Errorf("create topic %s: %w", name, err)
		}
	}
	return nil
}

// dbEnv is one scenario's database on one cluster: the application's pools
// and the router built from them.
type dbEnv struct {
	cluster *pgtest.Cluster
	name    string
	// producer writes; handlers read the primary through primary. Both
	// follow the primary across a promotion (see newDBEnv).
	producer, primary *pgxpool.Pool
	replicas          []replay.Replica
	replicaNodes      []*pgtest.Node
	// replicaDialer carries every connection to a replica, the router's
	// tracker included, so that a fault can hold new ones.
	replicaDialer *fault.Dialer
	router        *consume.Router
	// target is the port the producer and primary pools connect to when
	// they were made movable (see movePrimary); 0 otherwise.
	target atomic.Int64
}

// primaryDSN lists every node of the cluster with
// target_session_attrs=read-write: a connection goes to whichever node is
// the primary when it is made, as a multi-host libpq URL or a DNS name
// that moves with the primary would, so producers and the router follow a
// promotion without being rebuilt.
func primaryDSN(c *pgtest.Cluster, db string) string {
	var hosts []string
	for _, n := range c.Nodes() {
		hosts = append(hosts, fmt.Sprintf("127.0.0.1:%d", n.Port()))
	}
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
		strings.Join(hosts, ","), db)
}

// movableDSN is the primary's URL for pools whose BeforeConnect picks the
// port (dbEnv.target): read-write, so that a pool pointed at a standby
// that is not promoted yet fails to connect rather than read it.
func movableDSN(c *pgtest.Cluster, db string) string {
	return c.Primary().DSN(db) + "&target_session_attrs=read-write&connect_timeout=2"
}

// movePrimary points the movable pools' new connections at n, as a DNS
// name or a proxy that moves with the primary would; connections they
// already hold stay where they are until closed.
func (e *dbEnv) movePrimary(n *pgtest.Node) { e.target.Store(int64(n.Port())) }

var dbSeq atomic.Int64

// newDBEnv creates a database on c with the application's pools and a
// router built from them. Without movable, the producer and primary pools
// use primaryDSN; with it, movableDSN and whatever port movePrimary set
// last.
func newDBEnv(ctx context.Context, s *services, c *pgtest.Cluster, scenario string, rc consume.Config, movable bool) (*dbEnv, error) {
	e := &dbEnv{cluster: c, replicaDialer: fault.NewDialer(nil)}
	e.name = fmt.Sprintf("chaos_%s_%d", strings.ReplaceAll(scenario, "-", "_"), dbSeq.Add(1))
	if err := c.CreateDatabase(ctx, e.name); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			e.close()
		}
	}()
	var err error
	dsn, hook := primaryDSN(c, e.name), (func(context.Context, *pgx.ConnConfig) error)(nil)
	if movable {
		e.movePrimary(c.Primary())
		dsn = movableDSN(c, e.name)
		hook = func(_ context.Context, cc *pgx.ConnConfig) error {
			cc.Port = uint16(e.target.Load())
			return nil
		}
	}
	if e.producer, err = newPrimaryPool(ctx, dsn, 12, "chaos-producer", hook); err != nil {
		return nil, err
	}
	if e.primary, err = newPrimaryPool(ctx, dsn, 24, "chaos-primary", hook); err != nil {
		return nil, err
	}
	if _, err = e.producer.Exec(ctx, `CREATE TABLE items (id bigint PRIMARY KEY, version bigint NOT NULL)`); err != nil {
		return nil, err
	}
	if err = c.WaitReplicasCaughtUp(ctx); err != nil {
		return nil, err
	}
	for _, n := range c.Replicas() {
		p, err := newPool(ctx, n.DSN(e.name), 24, e.replicaDialer)
		if err != nil {
			return nil, err
		}
		e.replicas = append(e.replicas, replay.Replica{Name: n.Name(), Pool: p})
		e.replicaNodes = append(e.replicaNodes, n)
	}
	rc.Databases = map[string]replay.Database{"main": {Primary: e.primary, Replicas: e.replicas}}
	if rc.Logger == nil {
		rc.Logger = s.log
	}
	if e.router, err = consume.NewRouter(ctx, rc); err != nil {
		return nil, err
	}
	ok = true
	return e, nil
}

// newPrimaryPool opens a pool on the primary named app
// (application_name), whose new connections go through beforeConnect if
// it is set.
func newPrimaryPool(ctx context.Context, dsn string, size int32, app string, beforeConnect func(context.Context, *pgx.ConnConfig) error) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = size
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	cfg.BeforeConnect = beforeConnect
	return pgxpool.NewWithConfig(ctx, cfg)
}

// newPool opens a pool of size connections and, for pools a fault may
// hold, opens all of them now: a held dial must only hit the connections
// the tracker makes after its backend was stopped, not a handler pool that
// happens to grow during the fault.
func newPool(ctx context.Context, dsn string, size int32, d *fault.Dialer) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = size
	if d != nil {
		cfg.MinConns = size
		cfg.ConnConfig.DialFunc = d.DialContext
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if d != nil {
		conns := make([]*pgxpool.Conn, 0, size)
		for range size {
			c, err := p.Acquire(ctx)
			if err != nil {
				for _, c := range conns {
					c.Release()
				}
				p.Close()
				return nil, err
			}
			conns = append(conns, c)
		}
		for _, c := range conns {
			c.Release()
		}
	}
	return p, nil
}

func (e *dbEnv) close() {
	if e.router != nil {
		_ = e.router.Close()
	}
	for _, r := range e.replicas {
		r.Pool.Close()
	}
	for _, p := range []*pgxpool.Pool{e.producer, e.primary} {
		if p != nil {
			p.Close()
		}
	}
	// Dropping keeps the shared cluster small for the scenarios after
	// this one; a cluster that is being thrown away does not need it.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if p := e.cluster.Primary(); p != nil && p.Running() {
		_ = p.Exec(ctx, "", fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", e.name))
	}
}

// progress prints timestamped lines to stderr (or the test log).
type progress struct {
	mu    sync.Mutex
	start time.Time
	w     func(string)
}

func (p *progress) say(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.w(fmt.Sprintf("[%6.1fs] ", time.Since(p.start).Seconds()) + fmt.Sprintf(format, args...))
}

type redisLog struct{ l *slog.Logger }

func (r redisLog) Printf(ctx context.Context, format string, v ...any) {
	r.l.WarnContext(ctx, fmt.Sprintf(format, v...), "system", "go-redis")
}

// quietAsynq sends asynq's logs to the suite's log writer: during a Redis
// restart it logs every failed poll, which is expected.
type quietAsynq struct{ l *slog.Logger }

func (q quietAsynq) Debug(args ...any) {}
func (q quietAsynq) Info(args ...any)  {}
func (q quietAsynq) Warn(args ...any)  { q.l.Warn(fmt.Sprint(args...), "system", "asynq") }
func (q quietAsynq) Error(args ...any) { q.l.Error(fmt.Sprint(args...), "system", "asynq") }
func (q quietAsynq) Fatal(args ...any) { q.l.Error(fmt.Sprint(args...), "system", "asynq") }
