package kafkatest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// ConnectOptions configures StartConnect. The zero value is a standalone
// worker fit for tests.
type ConnectOptions struct {
	// Settings are extra worker properties, applied after (and so
	// overriding) the harness defaults (see workerSettings).
	Settings map[string]string
	// Heap is the worker JVM's maximum heap (-Xmx). Default "512m": the
	// worker, a Debezium task and its producer with room to spare.
	Heap string
	// JavaOptions are extra JVM options, after the harness's.
	JavaOptions []string
	// StartTimeout bounds the start until the REST API answers GET /health,
	// when ctx has no earlier deadline. Default 3 minutes, for the reason
	// given at Options.StartTimeout.
	StartTimeout time.Duration
	// Logf receives progress messages. Default: discarded.
	Logf func(format string, args ...any)
}

func (o ConnectOptions) heap() string {
	if o.Heap == "" {
		return "512m"
	}
	return o.Heap
}

// workerSettings: {brokers} are the bootstrap servers, {port} the REST
// port, {dir} the worker's directory, {plugins} the plugin path.
var workerSettings = [][2]string{
	{"bootstrap.servers", "{brokers}"},
	{"listeners", "http://127.0.0.1:{port}"},
	{"rest.advertised.host.name", "127.0.0.1"},
	{"rest.advertised.port", "{port}"},
	// Plain JSON, no schema envelope: what a Go consumer of CDC topics
	// parses. Records look like {"before":…,"after":…,"source":{…},"op":"c",…}.
	{"key.converter", "org.apache.kafka.connect.json.JsonConverter"},
	{"value.converter", "org.apache.kafka.connect.json.JsonConverter"},
	{"key.converter.schemas.enable", "false"},
	{"value.converter.schemas.enable", "false"},
	{"offset.storage.file.filename", "{dir}/connect.offsets"},
	// Debezium confirms positions to PostgreSQL (and so lets the slot
	// release WAL) when Connect commits offsets: every second, not every
	// ten.
	{"offset.flush.interval.ms", "1000"},
	{"plugin.path", "{plugins}"},
	// Find plugins through their ServiceLoader manifests (Debezium ships
	// them) instead of scanning every class of every jar: seconds faster.
	{"plugin.discovery", "service_load"},
}

// Connect is a Kafka Connect worker in standalone mode with the Debezium
// PostgreSQL connector installed, managed through its REST API.
type Connect struct {
	opts       ConnectOptions
	brokers    []string
	j          *jvm
	art        *Artifacts
	http       *http.Client
	transport  *http.Transport
	unregister func()
}

// StartConnect starts a standalone Connect worker against brokers (e.g.
// Broker.Brokers()) on a free loopback REST port and returns once GET
// /health answers 200. It runs no connector: create them with
// CreateConnector or StartPostgresConnector. On error nothing is left
// running.
func StartConnect(ctx context.Context, brokers []string, opts ConnectOptions) (*Connect, error) {
	if len(brokers) == 0 {
		return nil, errors.New("kafkatest: StartConnect needs broker addresses (Broker.Brokers())")
	}
	art, err := resolveJava(ctx, opts.Logf)
	if err != nil {
		return nil, err
	}
	began := time.Now()
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, startTimeout(opts.StartTimeout))
	defer cancel()
	j, err := newJVM("connect")
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 4, IdleConnTimeout: 30 * time.Second}
	c := &Connect{opts: opts, brokers: append([]string(nil), brokers...), art: art, j: j,
		transport: tr, http: &http.Client{Transport: tr, Timeout: 90 * time.Second}}
	j.ready = c.probe
	c.unregister = testsvc.Register(c.Close)
	if err := j.startFresh(ctx, c.startFresh); err != nil {
		_ = c.Close()
		return nil, err
	}
	c.logf("connect up in %v at %s (dir %s)", time.Since(began).Round(time.Millisecond), c.URL(), j.sb.Root())
	return c, nil
}

func (c *Connect) logf(format string, args ...any) {
	if c.opts.Logf != nil {
		c.opts.Logf("kafkatest: "+format, args...)
	}
}

func (c *Connect) startFresh(ctx context.Context) error {
	if err := c.j.pickPorts(1); err != nil {
		return err
	}
	vars := strings.NewReplacer("{brokers}", strings.Join(c.brokers, ","), "{port}", strconv.Itoa(c.j.port(0)),
		"{dir}", c.j.dir, "{plugins}", c.art.Plugins)
	cfg := filepath.Join(c.j.dir, "worker.properties")
	if err := writeProperties(cfg, workerSettings, vars, c.opts.Settings, "ConnectOptions.Settings"); err != nil {
		return err
	}
	cmd, err := c.j.javaCmd(c.opts.heap(), c.opts.JavaOptions, "-cp", classpath(c.art.Connect),
		"org.apache.kafka.connect.cli.ConnectStandalone", cfg)
	if err != nil {
		return err
	}
	return c.j.start(ctx, cmd)
}

// probe: GET /health answers 200 once the worker has finished starting
// (before that, 503), unlike GET /, which answers as soon as Jetty is up.
func (c *Connect) probe(ctx context.Context) error {
	status, body, err := c.do(ctx, http.MethodGet, "/health", nil)
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return fmt.Errorf("GET /health: %d %s", status, bytes.TrimSpace(body))
	}
	return nil
}

// URL is the REST API's base URL, e.g. http://127.0.0.1:12345.
func (c *Connect) URL() string {
	return "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(c.j.port(0)))
}

// Brokers are the bootstrap servers the worker was started with.
func (c *Connect) Brokers() []string { return append([]string(nil), c.brokers...) }

// Dir is the worker's temporary root directory.
func (c *Connect) Dir() string { return c.j.sb.Root() }

// LogPath is the worker's log, where connector and task errors land.
func (c *Connect) LogPath() string { return c.j.logPath }

// Running reports whether the worker JVM is alive.
func (c *Connect) Running() bool { return c.j.running() }

func (c *Connect) do(ctx context.Context, method, path string, body any) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.URL()+path, rd)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// CreateConnector creates (and starts) a connector; config needs at least
// connector.class. It returns once the worker accepted it; WaitRunning
// waits for it to run.
func (c *Connect) CreateConnector(ctx context.Context, name string, config map[string]string) error {
	status, body, err := c.do(ctx, http.MethodPost, "/connectors", map[string]any{"name": name, "config": config})
	if err != nil {
		return fmt.Errorf("kafkatest: create connector %q: %w", name, err)
	}
	if status != http.StatusCreated {
		return fmt.Errorf("kafkatest: create connector %q: %d %s; worker log %s", name, status, bytes.TrimSpace(body), c.LogPath())
	}
	return nil
}

// DeleteConnector stops and deletes a connector; an unknown name is not an
// error.
func (c *Connect) DeleteConnector(ctx context.Context, name string) error {
	status, body, err := c.do(ctx, http.MethodDelete, "/connectors/"+url.PathEscape(name), nil)
	if err != nil {
		return fmt.Errorf("kafkatest: delete connector %q: %w", name, err)
	}
	if status != http.StatusNoContent && status != http.StatusOK && status != http.StatusNotFound {
		return fmt.Errorf("kafkatest: delete connector %q: %d %s", name, status, bytes.TrimSpace(body))
	}
	return nil
}

// ConnectorStatus is GET /connectors/{name}/status.
type ConnectorStatus struct {
	Name      string     `json:"name"`
	Connector TaskStatus `json:"connector"`
	Tasks     []TaskStatus
}

// TaskStatus is the state of a connector or of one of its tasks: UNASSIGNED,
// RUNNING, PAUSED, STOPPED, FAILED or RESTARTING. Trace holds the Java stack
// trace of a FAILED one.
type TaskStatus struct {
	ID       int    `json:"id"`
	State    string `json:"state"`
	WorkerID string `json:"worker_id"`
	Trace    string `json:"trace,omitempty"`
}

// Status returns a connector's status.
func (c *Connect) Status(ctx context.Context, name string) (*ConnectorStatus, error) {
	status, body, err := c.do(ctx, http.MethodGet, "/connectors/"+url.PathEscape(name)+"/status", nil)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: status of connector %q: %w", name, err)
	}
	if status != http.StatusOK {
		return nil, fmt.Errorf("kafkatest: status of connector %q: %d %s", name, status, bytes.TrimSpace(body))
	}
	var st ConnectorStatus
	if err := json.Unmarshal(body, &st); err != nil {
		return nil, fmt.Errorf("kafkatest: status of connector %q: %w: %s", name, err, body)
	}
	return &st, nil
}

// failure returns an error when the connector or a task has FAILED, with
// the start of the Java trace (the cause is usually in its first lines).
func (st *ConnectorStatus) failure() error {
	all := append([]TaskStatus{st.Connector}, st.Tasks...)
	for i, t := range all {
		if t.State != "FAILED" {
			continue
		}
		what := "connector"
		if i > 0 {
			what = "task " + strconv.Itoa(t.ID)
		}
		return fmt.Errorf("kafkatest: connector %q: %s FAILED:\n%s", st.Name, what, firstLines(t.Trace, 12))
	}
	return nil
}

// running reports whether the connector and at least one task run, and
// every task does.
func (st *ConnectorStatus) running() bool {
	if st.Connector.State != "RUNNING" || len(st.Tasks) == 0 {
		return false
	}
	for _, t := range st.Tasks {
		if t.State != "RUNNING" {
			return false
		}
	}
	return true
}

// WaitRunning waits until the connector and all of its tasks are RUNNING,
// and fails at once, with the Java trace, if one of them FAILED. Without a
// deadline on ctx it gives up after 2 minutes.
func (c *Connect) WaitRunning(ctx context.Context, name string) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 2*time.Minute)
	defer cancel()
	var last string
	for {
		st, err := c.Status(ctx, name)
		if err == nil {
			if ferr := st.failure(); ferr != nil {
				return ferr
			}
			if st.running() {
				return nil
			}
			last = fmt.Sprintf("connector %s, tasks %v", st.Connector.State, st.Tasks)
		} else {
			last = err.Error()
		}
		if err := testsvc.SleepCtx(ctx, 100*time.Millisecond); err != nil {
			return fmt.Errorf("kafkatest: connector %q not RUNNING: %w (last: %s); worker log %s:\n%s", name, err, last, c.LogPath(), testsvc.LogTailN(c.LogPath(), 0, 30))
		}
	}
}

// Kill SIGKILLs the worker, as a crash would. There is no restart: start a
// new worker (the connectors' offsets died with this one's directory).
func (c *Connect) Kill() error {
	return c.j.crash()
}

// Connectors returns the names of the connectors the worker runs.
func (c *Connect) Connectors(ctx context.Context) ([]string, error) {
	status, body, err := c.do(ctx, http.MethodGet, "/connectors", nil)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: list connectors: %w", err)
	}
	if status != http.StatusOK {
		return nil, fmt.Errorf("kafkatest: list connectors: %d %s", status, bytes.TrimSpace(body))
	}
	var names []string
	if err := json.Unmarshal(body, &names); err != nil {
		return nil, fmt.Errorf("kafkatest: list connectors: %w in %q", err, firstLines(string(body), 3))
	}
	return names, nil
}

// Close stops the worker and removes its temp dir. While connectors run,
// the stop is clean (SIGTERM, up to 30 s) so that they run their own
// shutdown: a Debezium connector with slot.drop.on.stop drops its
// replication slot, which would otherwise hold WAL and block DROP
// DATABASE. A worker that runs none has nothing to finish and is killed:
// its clean stop (leaving the group, flushing the config topic) can take
// longer than any grace on a loaded 2-core machine, and its data is thrown
// away. Idempotent.
func (c *Connect) Close() error {
	sig, grace := syscall.SIGTERM, 30*time.Second
	if c.j.running() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		names, err := c.Connectors(ctx)
		cancel()
		if err == nil && len(names) == 0 {
			sig, grace = syscall.SIGKILL, 10*time.Second
		}
	}
	err := c.j.close(sig, grace)
	c.transport.CloseIdleConnections()
	c.unregister()
	return err
}

func firstLines(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	if len(lines) > n {
		lines = append(lines[:n], "\t…")
	}
	return strings.Join(lines, "\n")
}
