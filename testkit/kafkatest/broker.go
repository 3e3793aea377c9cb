package kafkatest

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// Options configures Start. The zero value is a broker fit for tests.
type Options struct {
	// Settings are extra server.properties entries, applied after (and so
	// overriding) the harness defaults (see brokerSettings), e.g.
	// {"num.partitions": "3"}.
	Settings map[string]string
	// Heap is the broker JVM's maximum heap (-Xmx). Default "384m": a test
	// broker holds a few small topics, and the machines run PostgreSQL
	// suites beside it.
	Heap string
	// JavaOptions are extra JVM options, placed after the harness's (see
	// jvmDefaults) so that they win.
	JavaOptions []string
	// StartTimeout bounds formatting the log dir, starting the JVM and the
	// first answered metadata request, when ctx has no earlier deadline.
	// Default 3 minutes: about 5 s on an idle 2-core machine, but a JVM
	// starting beside two PostgreSQL test suites can take many times that,
	// and a timeout there is a false failure.
	StartTimeout time.Duration
	// Logf receives progress messages (t.Logf fits). Default: discarded.
	Logf func(format string, args ...any)
	// Local starts a broker even when $KAFKA_BROKERS names an external
	// cluster: for tests that stop, kill or restart it.
	Local bool
	// Connect configures the shared worker of SharedConnect; Start ignores
	// it. Its Logf defaults to Logf.
	Connect ConnectOptions
}

func (o Options) heap() string {
	if o.Heap == "" {
		return "384m"
	}
	return o.Heap
}

// brokerSettings make a single-node KRaft broker (broker and controller in
// one process) quick to start and quick to serve tests. {broker} and
// {controller} are the ports, {logdir} the log directory.
var brokerSettings = [][2]string{
	{"process.roles", "broker,controller"},
	{"node.id", "1"},
	{"controller.quorum.bootstrap.servers", "127.0.0.1:{controller}"},
	{"listeners", "PLAINTEXT://127.0.0.1:{broker},CONTROLLER://127.0.0.1:{controller}"},
	{"advertised.listeners", "PLAINTEXT://127.0.0.1:{broker}"},
	{"controller.listener.names", "CONTROLLER"},
	{"inter.broker.listener.name", "PLAINTEXT"},
	{"listener.security.protocol.map", "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"},
	{"log.dirs", "{logdir}"},
	// Producers and consumers may name topics nobody created, as against a
	// default production broker.
	{"auto.create.topics.enable", "true"},
	{"num.partitions", "1"},
	{"default.replication.factor", "1"},
	{"min.insync.replicas", "1"},
	// Internal topics: one replica (there is one broker) and one partition,
	// so the first consumer group or transaction does not wait for dozens
	// of partitions to be created.
	{"offsets.topic.replication.factor", "1"},
	{"offsets.topic.num.partitions", "1"},
	{"transaction.state.log.replication.factor", "1"},
	{"transaction.state.log.min.isr", "1"},
	{"transaction.state.log.num.partitions", "1"},
	{"share.coordinator.state.topic.replication.factor", "1"},
	{"share.coordinator.state.topic.min.isr", "1"},
	{"share.coordinator.state.topic.num.partitions", "1"},
	// The default 3 s delay before the first rebalance of a new group is
	// for fleets of consumers joining together; a test would just wait.
	{"group.initial.rebalance.delay.ms", "0"},
	// A killed broker that restarts is refused (DUPLICATE_BROKER_REGISTRATION)
	// until the controller's session of its previous incarnation expires:
	// 9 s by default, which every chaos kill would wait out. 3 s still
	// leaves six missed heartbeats of slack for a JVM starved of CPU.
	{"broker.session.timeout.ms", "3000"},
	{"broker.heartbeat.interval.ms", "500"},
	// Fewer threads: less memory and less scheduling on two cores.
	{"num.network.threads", "2"},
	{"num.io.threads", "2"},
	{"background.threads", "2"},
	{"num.recovery.threads.per.data.dir", "1"},
	{"num.replica.fetchers", "1"},
	{"log.cleaner.threads", "1"},
	// The cleaner allocates its dedupe buffer on the heap up front: 128 MB
	// by default, a third of the heap given here.
	{"log.cleaner.dedupe.buffer.size", "8388608"},
	// Index files are preallocated at this size; sandboxes are usually in
	// /dev/shm, i.e. RAM.
	{"log.index.size.max.bytes", "1048576"},
}

// Broker is a single-node Apache Kafka (KRaft) broker in a temp dir, or an
// external cluster named by $KAFKA_BROKERS.
type Broker struct {
	opts       Options
	external   []string
	j          *jvm
	art        *Artifacts
	dataDir    string
	unregister func()
}

// Start starts a broker on free loopback ports and returns once it answers
// a metadata request that lists it. With $KAFKA_BROKERS set (host:port,
// comma-separated) and Options.Local unset it starts nothing and returns a
// Broker for that cluster, whose Stop, Kill and Start fail. On error nothing
// is left running.
//
// The jars are resolved first if the cache lacks them (see Resolve); that
// has its own 10-minute budget, outside StartTimeout.
func Start(ctx context.Context, opts Options) (*Broker, error) {
	if env := os.Getenv("KAFKA_BROKERS"); strings.TrimSpace(env) != "" && !opts.Local {
		var addrs []string
		for _, a := range strings.Split(env, ",") {
			if a = strings.TrimSpace(a); a != "" {
				addrs = append(addrs, a)
			}
		}
		return &Broker{opts: opts, external: addrs}, nil
	}
	art, err := resolveJava(ctx, opts.Logf)
	if err != nil {
		return nil, err
	}
	began := time.Now()
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, startTimeout(opts.StartTimeout))
	defer cancel()
	j, err := newJVM("broker")
	if err != nil {
		return nil, err
	}
	b := &Broker{opts: opts, art: art, j: j, dataDir: filepath.Join(j.dir, "data")}
	j.ready = b.probe
	b.unregister = testsvc.Register(b.Close)
	if err := j.startFresh(ctx, b.startFresh); err != nil {
		_ = b.Close()
		return nil, err
	}
	b.logf("broker up in %v on %s (controller :%d, dir %s)", time.Since(began).Round(time.Millisecond), b.Addr(), b.j.port(1), j.sb.Root())
	return b, nil
}

func (b *Broker) logf(format string, args ...any) {
	if b.opts.Logf != nil {
		b.opts.Logf("kafkatest: "+format, args...)
	}
}

// startFresh picks ports, writes the configuration, formats the log dir and
// starts the broker. The controller's address is written into the log dir by
// the format (--standalone), so a retry on other ports formats again.
func (b *Broker) startFresh(ctx context.Context) error {
	if err := b.j.pickPorts(2); err != nil {
		return err
	}
	if err := os.RemoveAll(b.dataDir); err != nil {
		return fmt.Errorf("kafkatest: %w", err)
	}
	if err := b.writeConfig(); err != nil {
		return err
	}
	id, err := clusterID()
	if err != nil {
		return err
	}
	t0 := time.Now()
	cmd, err := b.j.javaCmd("256m", b.opts.JavaOptions, "-cp", classpath(b.art.Broker),
		"kafka.tools.StorageTool", "format", "--standalone", "-t", id, "-c", b.configPath())
	if err != nil {
		return err
	}
	if err := b.j.run(ctx, "kafka-storage format", cmd); err != nil {
		return err
	}
	b.logf("log dir formatted in %v", time.Since(t0).Round(time.Millisecond))
	return b.launch(ctx)
}

func (b *Broker) launch(ctx context.Context) error {
	cmd, err := b.j.javaCmd(b.opts.heap(), b.opts.JavaOptions, "-cp", classpath(b.art.Broker),
		"kafka.Kafka", b.configPath())
	if err != nil {
		return err
	}
	t0 := time.Now()
	if err := b.j.start(ctx, cmd); err != nil {
		return err
	}
	t1 := time.Now()
	if err := b.warmGroupCoordinator(ctx); err != nil {
		return err
	}
	b.logf("broker JVM answering metadata after %v, group coordinator after %v more", t1.Sub(t0).Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))
	return nil
}

// warmGroupCoordinator creates and loads __consumer_offsets before Start
// returns. Otherwise the first consumer group of a test meets
// GROUP_COORDINATOR_NOT_AVAILABLE or NOT_COORDINATOR for a while: clients
// retry those, but a test would spend its first second or two on it, or
// worse, count them.
func (b *Broker) warmGroupCoordinator(ctx context.Context) error {
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	c := &kafka.Client{Addr: kafka.TCP(b.Addr()), Transport: tr, Timeout: 5 * time.Second}
	var last error
	for {
		fc, err := c.FindCoordinator(ctx, &kafka.FindCoordinatorRequest{Key: "kafkatest-warmup", KeyType: kafka.CoordinatorKeyTypeConsumer})
		if err == nil {
			err = fc.Error
		}
		if err == nil {
			var of *kafka.OffsetFetchResponse
			of, err = c.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: "kafkatest-warmup", Topics: map[string][]int{"kafkatest-warmup": {0}}})
			if err == nil {
				err = of.Error
			}
		}
		if err == nil {
			return nil
		}
		last = err
		if err := testsvc.SleepCtx(ctx, 50*time.Millisecond); err != nil {
			b.j.kill()
			return fmt.Errorf("kafkatest: the broker answers metadata requests but its group coordinator never became available (%w; last: %v); log %s:\n%s",
				err, last, b.LogPath(), testsvc.LogTailN(b.LogPath(), 0, 30))
		}
	}
}

func (b *Broker) configPath() string { return filepath.Join(b.j.dir, "server.properties") }

func (b *Broker) writeConfig() error {
	vars := strings.NewReplacer("{broker}", strconv.Itoa(b.j.port(0)), "{controller}", strconv.Itoa(b.j.port(1)), "{logdir}", b.dataDir)
	return writeProperties(b.configPath(), brokerSettings, vars, b.opts.Settings, "Options.Settings")
}

// clusterID is what kafka-storage random-uuid prints: 16 random bytes,
// unpadded URL-safe base64, never starting with '-'. Kafka's
// Uuid.randomUuid draws again in that case too: StorageTool's argument
// parser takes "-t -abc…" for a missing value and an unknown option, which
// failed one broker start in 64.
func clusterID() (string, error) {
	for {
		var u [16]byte
		if _, err := rand.Read(u[:]); err != nil {
			return "", fmt.Errorf("kafkatest: %w", err)
		}
		if id := base64.RawURLEncoding.EncodeToString(u[:]); id[0] != '-' {
			return id, nil
		}
	}
}

// probe is the readiness check: a metadata request that lists this broker.
// An open port is not enough: the socket server accepts before the broker
// has caught up with the controller and registered.
func (b *Broker) probe(ctx context.Context) error {
	conn, err := kafka.DialContext(ctx, "tcp", b.Addr())
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	brokers, err := conn.Brokers()
	if err != nil {
		return err
	}
	want := b.j.port(0)
	for _, br := range brokers {
		if br.Port == want {
			return nil
		}
	}
	return fmt.Errorf("metadata lists brokers %v, not :%d yet", brokers, want)
}

// Addr is the first bootstrap address, host:port.
func (b *Broker) Addr() string { return b.Brokers()[0] }

// Brokers are the bootstrap addresses for kafka.Writer, kafka.ReaderConfig
// and kafka.TCP.
func (b *Broker) Brokers() []string {
	if b.external != nil {
		return append([]string(nil), b.external...)
	}
	return []string{net.JoinHostPort("127.0.0.1", strconv.Itoa(b.j.port(0)))}
}

// External reports whether this is a cluster named by $KAFKA_BROKERS.
func (b *Broker) External() bool { return b.external != nil }

// Dir is the broker's temporary root directory ("" when External).
func (b *Broker) Dir() string {
	if b.j == nil {
		return ""
	}
	return b.j.sb.Root()
}

// LogPath is the broker's log (stdout and stderr), for failure messages.
func (b *Broker) LogPath() string {
	if b.j == nil {
		return ""
	}
	return b.j.logPath
}

var errExternal = errors.New("kafkatest: the broker is external ($KAFKA_BROKERS) and cannot be stopped or started from here")

// Running reports whether the broker JVM is alive; true for an external
// cluster.
func (b *Broker) Running() bool {
	if b.external != nil {
		return true
	}
	return b.j.running()
}

// Stop shuts the broker down cleanly (SIGTERM, controlled shutdown) and
// waits until ctx's deadline (default 30 s), then kills it. Its ports stay
// reserved, so clients get "connection refused" until Start.
func (b *Broker) Stop(ctx context.Context) error {
	if b.external != nil {
		return errExternal
	}
	b.j.opMu.Lock()
	defer b.j.opMu.Unlock()
	grace := 30 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		grace = max(time.Until(dl), time.Second)
	}
	return b.j.halt(syscall.SIGTERM, grace)
}

// Kill SIGKILLs the broker, as a crash would, and waits.
func (b *Broker) Kill() error {
	if b.external != nil {
		return errExternal
	}
	return b.j.crash()
}

// Start restarts a stopped or killed broker on the same ports with the same
// data and returns once it answers metadata requests.
func (b *Broker) Start(ctx context.Context) error {
	if b.external != nil {
		return errExternal
	}
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, startTimeout(b.opts.StartTimeout))
	defer cancel()
	b.j.opMu.Lock()
	defer b.j.opMu.Unlock()
	if b.j.running() {
		return nil
	}
	return b.launch(ctx)
}

// Close kills the broker and removes its temp dir; the data is thrown
// away, so there is no point in a clean shutdown. Idempotent; a no-op for
// an external cluster.
func (b *Broker) Close() error {
	if b.external != nil {
		return nil
	}
	err := b.j.close(syscall.SIGKILL, 10*time.Second)
	b.unregister()
	return err
}

// CreateTopic creates a topic with the broker's default replication factor
// and waits until every partition has a leader, so that a producer started
// right after does not begin with LEADER_NOT_AVAILABLE retries. An existing
// topic is an error (kafka.TopicAlreadyExists): tests should use fresh names.
func (b *Broker) CreateTopic(ctx context.Context, name string, partitions int) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	c := &kafka.Client{Addr: kafka.TCP(b.Brokers()...), Transport: tr}
	resp, err := c.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{
		Topic: name, NumPartitions: partitions, ReplicationFactor: -1,
	}}})
	if err != nil {
		return fmt.Errorf("kafkatest: create topic %q: %w", name, err)
	}
	if err := resp.Errors[name]; err != nil {
		return fmt.Errorf("kafkatest: create topic %q: %w", name, err)
	}
	for {
		md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{name}})
		if err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil && len(md.Topics[0].Partitions) == partitions {
			ready := true
			for _, p := range md.Topics[0].Partitions {
				ready = ready && p.Error == nil && p.Leader.Host != ""
			}
			if ready {
				return nil
			}
		}
		if err := testsvc.SleepCtx(ctx, 20*time.Millisecond); err != nil {
			return fmt.Errorf("kafkatest: topic %q created but its partitions have no leader: %w; log %s", name, err, b.LogPath())
		}
	}
}
