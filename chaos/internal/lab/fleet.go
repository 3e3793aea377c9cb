package lab

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/catchup"
	"github.com/caughtup/caughtup/testkit/latency"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The fleet simulation (`make fleet`, `go run ./chaos/fleet`): N routers, each
// with its own Redis client (its subscription and its fleet budget's
// connections), in one or several worker processes (this binary started
// again, at most -per-process routers each), against one real PostgreSQL
// primary with two streaming replicas and one redis-server. Rows: routers
// on a signed feed of two publishers (replay.Publisher, every 10ms, in
// the parent process) for each -feed N, and routers polling by
// themselves for each -local N, "max" being the most the servers'
// max_connections leave room for (each such router holds one connection
// per node). Per row:
//
//   - replica status queries/s per replica, counted by each replica
//     (pg_stat_statements calls of the tracker's replica query), over an
//     idle window and while the latency trials' jobs wait;
//   - Redis commands/s (INFO commandstats), PUBLISHes/s, deliveries/s
//     (observations the routers received, caughtup.feed.received) against
//     PUBLISHes × N, and redis-server's CPU (INFO cpu);
//   - catch-up → wake: replay paused on both replicas, a row written, one
//     Delayed job per router waiting for its token, replay resumed; per
//     router, from the moment a replica passed the token (a probe looping
//     on pg_last_wal_replay_lsn() on its own connection to each replica,
//     midpoint of the first query that saw it) to the job's Route
//     returning; and, on the feed, from the first publisher read that
//     showed it (firstCaughtUp over the publishers' recorded
//     snapshots);
//   - a 10s lag spike: replay paused, Sticky jobs at -spike-rate in all
//     (spread over the routers) for a token ahead of the replicas; every
//     fallback to the primary must pass the router's own cap (PrimaryRate
//     50/s, PrimaryBurst 100) and the fleet budget (feed.Budget, GCRA in
//     Redis, -budget per second, burst the same). Reported: the most
//     fallback reads admitted in any 1s window (decision times) against
//     rate + burst, and, from the same attempts, what a token bucket per
//     router with its own cap alone would have admitted;
//   - router fallbacks to local polling during the row (Router.Feed);
//   - connections: per replica, the sessions its server counted for the
//     fleet's database (pg_stat_database.sessions) while the routers
//     started (spawn to the end of the idle window) and over every
//     router's first job (a Snapshot per router: on the feed it has the
//     router identify its replicas, one connection each, retried with
//     backoff when refused), and the connections the replica refused for
//     max_connections over the row (its log's "too many clients
//     already").

// fleetOptions are FleetMain's flags.
type fleetOptions struct {
	feedNs     []int
	localNs    []int // fleetMaxN: as many as the connection limit allows
	trials     int
	idle       time.Duration
	spike      time.Duration
	spikeRate  float64
	budget     fleetBudget
	perProcess int
	batch      int
	jsonPath   string
}

const fleetMaxN = -1

// fleetRow is one line of the table.
type fleetRow struct {
	Mode      string `json:"mode"` // feed or local
	Routers   int    `json:"routers"`
	Processes int    `json:"processes"`

	QueriesIdle    []float64 `json:"replica_status_queries_per_s_idle"`
	QueriesWaiting []float64 `json:"replica_status_queries_per_s_while_jobs_wait"`
	// The routers' share of those (the rest are the publishers').
	RouterQueriesIdle    []float64 `json:"router_status_queries_per_s_idle"`
	RouterQueriesWaiting []float64 `json:"router_status_queries_per_s_while_jobs_wait"`
	RedisCmds            float64   `json:"redis_commands_per_s"`
	Publishes            float64   `json:"redis_publish_per_s"`
	Deliveries           float64   `json:"deliveries_per_s"`
	RedisCPU             float64   `json:"redis_cpu_percent"`
	RoutersCPU           float64   `json:"routers_cpu_percent"`
	PublishersCPU        float64   `json:"publishers_process_cpu_percent"`

	WakeP50    float64        `json:"catchup_to_wake_p50_ms"`
	WakeP99    float64        `json:"catchup_to_wake_p99_ms"`
	PubWakeP50 float64        `json:"publisher_read_to_wake_p50_ms,omitempty"`
	PubWakeP99 float64        `json:"publisher_read_to_wake_p99_ms,omitempty"`
	Samples    int            `json:"wake_samples"`
	Outcomes   map[string]int `json:"wake_outcomes"`

	SpikeAttempts    int              `json:"spike_attempts"`
	SpikeAdmitted    int              `json:"spike_fallbacks_admitted"`
	SpikeCapped      int              `json:"spike_capped"`
	SpikeErrors      int              `json:"spike_errors"`
	SpikeMax1s       int              `json:"spike_max_fallbacks_1s"`
	SpikeLimit       int              `json:"spike_budget_limit_1s"`
	SpikeMean        float64          `json:"spike_fallbacks_per_s"`
	SpikeLocalMax1s  int              `json:"spike_per_process_caps_alone_max_1s"`
	SpikeLocalBound  int              `json:"spike_per_process_caps_bound_1s"`
	SpikeBudgetCalls map[string]int64 `json:"spike_budget_checks"`

	// Per replica, the connections its server counted for the fleet's
	// database (pg_stat_database.sessions) from before the workers were
	// spawned to the end of the idle window (StartSessions), and over the
	// first job of every router (FirstJobSessions: a Snapshot per router,
	// which on the feed has the routers identify their replicas); and the
	// connections it refused with "too many clients already" over the
	// whole row (counted in its log).
	StartSessions    []int64 `json:"replica_sessions_while_routers_start"`
	FirstJobSessions []int64 `json:"replica_sessions_at_first_jobs"`
	Refused          []int64 `json:"replica_refused_too_many_clients"`
	FirstJobsMs      float64 `json:"first_jobs_identified_ms"`

	Fallbacks uint64   `json:"router_fallbacks"`
	Notes     []string `json:"notes,omitempty"`
	Err       string   `json:"error,omitempty"`
}

// FleetMain runs the fleet simulation with command-line args (without the
// program name), printing the table to stdout and progress to stderr. In a
// process started as one of its workers (IsFleetWorker) it serves the
// parent instead.
func FleetMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if IsFleetWorker() {
		return RunFleetWorker(ctx, os.Stdin, stdout, stderr)
	}
	fs := flag.NewFlagSet("fleet", flag.ContinueOnError)
	fs.SetOutput(stdout)
	fs.Usage = func() {
		fmt.Fprintln(stdout, "usage: go run ./chaos/fleet [-feed 10,100,1000] [-local 10,max] [-trials 20] [-json FILE]\n\n"+
			"Simulates a fleet of routers, on a position feed or polling by themselves, against a real\n"+
			"PostgreSQL primary with 2 streaming replicas and a real redis-server, and prints what each\n"+
			"costs the replicas and Redis, how soon waiting jobs wake, and how many primary fallbacks a\n"+
			"10s lag spike lets through under the fleet budget.")
		fs.PrintDefaults()
	}
	feedNs := fs.String("feed", "10,100,1000", "router counts on the feed")
	localNs := fs.String("local", "10,max", "router counts polling by themselves (max: as many as max_connections leaves room for)")
	o := fleetOptions{}
	fs.IntVar(&o.trials, "trials", 20, "latency trials per row (one job per router each)")
	fs.DurationVar(&o.idle, "idle", 5*time.Second, "the idle measuring window")
	fs.DurationVar(&o.spike, "spike", 10*time.Second, "the lag spike")
	fs.Float64Var(&o.spikeRate, "spike-rate", 1000, "Sticky jobs per second during the spike, across all routers")
	fs.IntVar(&o.budget.Rate, "budget", 200, "the fleet budget, primary fallback reads per second (burst the same)")
	fs.DurationVar(&o.budget.Timeout, "budget-timeout", 500*time.Millisecond,
		"the fleet budget's Timeout: a check not answered within it lets the router's own cap alone decide (the library's default is 50ms, which a 2-core machine running the whole fleet misses)")
	fs.IntVar(&o.perProcess, "per-process", 250, "at most this many routers per worker process")
	fs.IntVar(&o.batch, "batch", 50, "routers started at once in a worker (each polls every node once at start)")
	fs.StringVar(&o.jsonPath, "json", "fleet-results.json", "write the rows as JSON to this file")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	o.budget.Burst = o.budget.Rate
	var err error
	if o.feedNs, err = parseCounts(*feedNs); err == nil {
		o.localNs, err = parseCounts(*localNs)
	}
	if err != nil {
		fmt.Fprintf(stderr, "fleet: %v\n", err)
		return 2
	}
	out := &progress{start: time.Now(), w: func(s string) { fmt.Fprintln(stderr, s) }}
	rows, err := runFleet(ctx, o, out)
	printFleet(stdout, rows, o)
	if o.jsonPath != "" {
		if b, jerr := json.MarshalIndent(rows, "", "  "); jerr == nil {
			if werr := os.WriteFile(o.jsonPath, append(b, '\n'), 0o644); werr != nil {
				fmt.Fprintf(stderr, "fleet: writing %s: %v\n", o.jsonPath, werr)
			}
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "fleet: %v\n", err)
		return 1
	}
	for _, r := range rows {
		if r.Err != "" {
			return 1
		}
	}
	return 0
}

func parseCounts(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		f = strings.TrimSpace(f)
		switch {
		case f == "":
		case f == "max":
			out = append(out, fleetMaxN)
		default:
			n, err := strconv.Atoi(f)
			if err != nil || n < 1 {
				return nil, fmt.Errorf("bad router count %q", f)
			}
			out = append(out, n)
		}
	}
	return out, nil
}

// fleetEnv is the simulation's services and the parent's own connections.
type fleetEnv struct {
	o      fleetOptions
	out    *progress
	log    *slog.Logger
	logDir string
	// keepLogs: a row failed, so logDir stays for its workers' logs.
	keepLogs bool
	logFile  *os.File
	cluster  *pgtest.Cluster
	redis    *pgtest.Redis
	db       string
	primary  *pgxpool.Pool // writes
	dbs      map[string]replay.Database
	pubDBs   map[string]replay.Database // the same, as fleetPublisherRole
	stats    []*pgx.Conn                // per replica: pg_stat_statements
	probes   []*pgx.Conn                // per replica: the catch-up probe
	ctrl     []*pgx.Conn                // per replica: pausing and resuming replay
	admin    *redis.Client
	keys     feed.Keyring
	keyText  string
	feed     string
	pubs     []*replay.Publisher
	pubRdb   []*redis.Client
}

func runFleet(ctx context.Context, o fleetOptions, out *progress) ([]fleetRow, error) {
	e := &fleetEnv{o: o, out: out, db: "fleet", feed: "fleet"}
	defer e.close()
	if err := e.start(ctx); err != nil {
		return nil, err
	}
	var rows []fleetRow
	for _, n := range o.feedNs {
		if len(e.pubs) == 0 {
			if err := e.startPublishers(ctx); err != nil {
				return rows, err
			}
		}
		rows = append(rows, e.row(ctx, "feed", n))
	}
	e.stopPublishers()
	for _, n := range o.localNs {
		if n == fleetMaxN {
			var why string
			var err error
			if n, why, err = e.maxLocal(ctx); err != nil {
				return rows, err
			}
			out.say("local polling: at most %d routers fit (%s)", n, why)
			r := e.row(ctx, "local", n)
			r.Notes = append(r.Notes, "the largest N here: "+why)
			rows = append(rows, r)
			continue
		}
		rows = append(rows, e.row(ctx, "local", n))
	}
	return rows, ctx.Err()
}

func (e *fleetEnv) start(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "caughtup-fleet-")
	if err != nil {
		return err
	}
	e.logDir = dir
	lf, err := os.Create(filepath.Join(dir, "fleet.log"))
	if err != nil {
		return err
	}
	e.logFile = lf
	e.log = slog.New(slog.NewTextHandler(lf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	e.out.say("starting PostgreSQL (primary + 2 streaming replicas, pg_stat_statements) and redis-server; logs in %s", dir)
	if e.cluster, err = pgtest.Start(ctx, pgtest.Options{Replicas: 2, Logf: e.out.say,
		Settings: map[string]string{"shared_preload_libraries": "'pg_stat_statements'"}}); err != nil {
		return err
	}
	if e.redis, err = pgtest.StartRedis(ctx); err != nil {
		return err
	}
	if err := e.cluster.CreateDatabase(ctx, e.db); err != nil {
		return err
	}
	pc := e.cluster.Primary()
	if e.primary, err = pgxpool.New(ctx, pc.DSN(e.db)); err != nil {
		return err
	}
	// The publishers connect as a role of their own, so that each
	// replica's pg_stat_statements tells their queries from the routers'.
	if _, err := e.primary.Exec(ctx, `CREATE EXTENSION pg_stat_statements; CREATE TABLE items (id bigint PRIMARY KEY, v bigint NOT NULL);
		CREATE ROLE `+fleetPublisherRole+` LOGIN SUPERUSER`); err != nil {
		return err
	}
	if err := e.cluster.WaitReplicasCaughtUp(ctx); err != nil {
		return err
	}
	var reps []replay.Replica
	for _, n := range e.cluster.Replicas() {
		p, err := pgxpool.New(ctx, n.DSN(e.db))
		if err != nil {
			return err
		}
		reps = append(reps, replay.Replica{Name: n.Name(), Pool: p})
		// Connections of its own, opened now: under a large fleet's load a
		// new connection can take seconds.
		for _, conns := range []*[]*pgx.Conn{&e.stats, &e.probes, &e.ctrl} {
			c, err := pgx.Connect(ctx, n.DSN(e.db))
			if err != nil {
				return err
			}
			*conns = append(*conns, c)
		}
	}
	e.dbs = map[string]replay.Database{"main": {Primary: e.primary, Replicas: reps}}
	// The publishers' pools: the same nodes as the publisher role. A
	// Publisher makes its own connections from their configs.
	pubDB := replay.Database{}
	if pubDB.Primary, err = pgxpool.New(ctx, asPublisher(pc.DSN(e.db))); err != nil {
		return err
	}
	for _, n := range e.cluster.Replicas() {
		p, err := pgxpool.New(ctx, asPublisher(n.DSN(e.db)))
		if err != nil {
			return err
		}
		pubDB.Replicas = append(pubDB.Replicas, replay.Replica{Name: n.Name(), Pool: p})
	}
	e.pubDBs = map[string]replay.Database{"main": pubDB}
	e.admin = redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
	k, err := feed.GenerateKey("fleet1")
	if err != nil {
		return err
	}
	e.keys, e.keyText = feed.Keyring{Keys: []feed.Key{k}}, k.Export()
	return nil
}

func (e *fleetEnv) close() {
	defer func() {
		if e.logFile != nil {
			_ = e.logFile.Close()
		}
		switch {
		case e.logDir == "":
		case e.keepLogs:
			e.out.say("logs kept in %s", e.logDir)
		default:
			_ = os.RemoveAll(e.logDir)
		}
	}()
	e.stopPublishers()
	for _, c := range append(append(e.stats, e.probes...), e.ctrl...) {
		_ = c.Close(context.Background())
	}
	for _, dbs := range []map[string]replay.Database{e.dbs, e.pubDBs} {
		for _, db := range dbs {
			for _, r := range db.Replicas {
				r.Pool.Close()
			}
			if db.Primary != e.primary {
				db.Primary.Close()
			}
		}
	}
	if e.primary != nil {
		e.primary.Close()
	}
	if e.admin != nil {
		_ = e.admin.Close()
	}
	if e.redis != nil {
		_ = e.redis.Close()
	}
	if e.cluster != nil {
		_ = e.cluster.Close()
	}
}

// startPublishers starts two publishers of the feed in this process,
// each with its own Redis client and its own connection to every node.
func (e *fleetEnv) startPublishers(ctx context.Context) error {
	for _, name := range []string{"pub-a", "pub-b"} {
		rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
		snd, err := feed.NewSender(feed.SenderConfig{Client: rdb, Feed: e.feed, Name: name, Keys: e.keys, Logger: e.log})
		if err != nil {
			_ = rdb.Close()
			return err
		}
		p, err := replay.NewPublisher(ctx, e.pubDBs, replay.PublisherConfig{Feed: snd, Logger: e.log})
		if err != nil {
			_ = rdb.Close()
			return err
		}
		e.pubs, e.pubRdb = append(e.pubs, p), append(e.pubRdb, rdb)
	}
	e.out.say("2 publishers on feed %q, every %s", e.feed, replay.DefaultFeedInterval)
	return nil
}

func (e *fleetEnv) stopPublishers() {
	for _, p := range e.pubs {
		_ = p.Close()
	}
	for _, c := range e.pubRdb {
		_ = c.Close()
	}
	e.pubs, e.pubRdb = nil, nil
}

// fleetPublisherRole is the PostgreSQL role the publishers connect as.
const fleetPublisherRole = "feedpub"

// asPublisher is a pgtest connection string with the publisher role as
// its user.
func asPublisher(dsn string) string {
	return strings.Replace(dsn, "postgres://postgres@", "postgres://"+fleetPublisherRole+"@", 1)
}

// maxLocal is the most routers polling by themselves that every node's
// connection limit leaves room for: each holds one connection per node,
// besides what is connected now, the superuser reserve, the workers'
// primary pool (2) and a margin of 5.
func (e *fleetEnv) maxLocal(ctx context.Context) (int, string, error) {
	best := math.MaxInt
	var parts []string
	for _, n := range e.cluster.Nodes() {
		c, err := pgx.Connect(ctx, n.DSN(e.db))
		if err != nil {
			return 0, "", err
		}
		var maxc, reserved, used int
		err = c.QueryRow(ctx, `SELECT current_setting('max_connections')::int, current_setting('superuser_reserved_connections')::int,
			(SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int`).Scan(&maxc, &reserved, &used)
		_ = c.Close(ctx)
		if err != nil {
			return 0, "", err
		}
		free := maxc - reserved - used
		best = min(best, free)
		parts = append(parts, fmt.Sprintf("%s: max_connections %d - %d reserved - %d in use", n.Name(), maxc, reserved, used))
	}
	n := best - 2 - 5
	return n, fmt.Sprintf("%s; one connection per node per router, less 2 for the workers' primary pool and a margin of 5", strings.Join(parts, "; ")), nil
}

// fleetWorkerProc is one worker process and its replies.
type fleetWorkerProc struct {
	n       int
	cmd     *exec.Cmd
	in      io.WriteCloser
	replies chan fleetReply
	logPath string
}

func (e *fleetEnv) spawn(i, n int) (*fleetWorkerProc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	w := &fleetWorkerProc{n: n, replies: make(chan fleetReply, 16), logPath: filepath.Join(e.logDir, fmt.Sprintf("worker-%d.log", i))}
	lf, err := os.OpenFile(w.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	w.cmd = exec.Command(exe)
	w.cmd.Env = append(os.Environ(), fleetWorkerEnv+"=1")
	w.cmd.Stderr = lf
	if w.in, err = w.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	stdout, err := w.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := w.cmd.Start(); err != nil {
		return nil, err
	}
	_ = lf.Close()
	go func() {
		defer close(w.replies)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 64<<20)
		for sc.Scan() {
			var r fleetReply
			if json.Unmarshal(sc.Bytes(), &r) == nil {
				w.replies <- r
			}
		}
	}()
	return w, nil
}

func (w *fleetWorkerProc) send(c fleetCommand) error {
	b, err := json.Marshal(c)
	if err != nil {
		return err
	}
	_, err = w.in.Write(append(b, '\n'))
	return err
}

// recv waits for the reply op.
func (w *fleetWorkerProc) recv(op string, d time.Duration) (fleetReply, error) {
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case r, ok := <-w.replies:
			if !ok {
				return r, fmt.Errorf("worker exited (log %s)", w.logPath)
			}
			if r.Op == op {
				if r.Err != "" {
					return r, fmt.Errorf("worker: %s (log %s)", r.Err, w.logPath)
				}
				return r, nil
			}
			if r.Op == "error" {
				return r, fmt.Errorf("worker: %s", r.Err)
			}
		case <-t.C:
			return fleetReply{}, fmt.Errorf("no %q from a worker within %s (log %s)", op, d, w.logPath)
		}
	}
}

func (w *fleetWorkerProc) stop() {
	_ = w.send(fleetCommand{Op: "stop"})
	done := make(chan struct{})
	go func() { _ = w.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = w.cmd.Process.Kill()
		<-done
	}
}

// all sends c to every worker and collects each one's reply op.
func all(ws []*fleetWorkerProc, c fleetCommand, op string, d time.Duration) ([]fleetReply, error) {
	for _, w := range ws {
		if err := w.send(c); err != nil {
			return nil, err
		}
	}
	return collect(ws, op, d)
}

// collect waits for every worker's reply op.
func collect(ws []*fleetWorkerProc, op string, d time.Duration) ([]fleetReply, error) {
	out := make([]fleetReply, len(ws))
	errs := make([]error, len(ws))
	var wg sync.WaitGroup
	for i, w := range ws {
		wg.Go(func() { out[i], errs[i] = w.recv(op, d) })
	}
	wg.Wait()
	return out, errors.Join(errs...)
}

// fleetCounters are the server-side counts a row's rates come from.
type fleetCounters struct {
	at      time.Time
	queries []int64 // per replica: the tracker's replica query, from anyone
	// routerQueries are those of the routers (not the publisher role).
	routerQueries []int64
	redisCmds     int64
	publishes     int64
	redisCPU      float64 // seconds
	// routersCPU is the worker processes' CPU time, selfCPU this
	// process's (the publishers', on the feed), in seconds.
	routersCPU, selfCPU float64
	received            int64
	fallbacks           uint64
}

func (e *fleetEnv) counters(ctx context.Context, ws []*fleetWorkerProc) (fleetCounters, error) {
	c := fleetCounters{at: time.Now()}
	for _, s := range e.stats {
		var all, routers int64
		if err := s.QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::int8,
				coalesce(sum(calls) FILTER (WHERE userid <> (SELECT oid FROM pg_roles WHERE rolname = $1)), 0)::int8
			FROM pg_stat_statements WHERE query LIKE 'SELECT r,%'`, fleetPublisherRole).Scan(&all, &routers); err != nil {
			return c, err
		}
		c.queries = append(c.queries, all)
		c.routerQueries = append(c.routerQueries, routers)
	}
	info, err := e.admin.Info(ctx, "commandstats", "cpu").Result()
	if err != nil {
		return c, err
	}
	for line := range strings.SplitSeq(info, "\n") {
		line = strings.TrimSpace(line)
		if name, rest, ok := strings.Cut(line, ":calls="); ok {
			n, _ := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
			c.redisCmds += n
			if name == "cmdstat_publish" {
				c.publishes = n
			}
		}
		for _, k := range []string{"used_cpu_sys:", "used_cpu_user:"} {
			if v, ok := strings.CutPrefix(line, k); ok {
				f, _ := strconv.ParseFloat(v, 64)
				c.redisCPU += f
			}
		}
	}
	stats, err := all(ws, fleetCommand{Op: "stats"}, "stats", time.Minute)
	if err != nil {
		return c, err
	}
	for _, w := range ws {
		c.routersCPU += processCPU(w.cmd.Process.Pid)
	}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		c.selfCPU = time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
	}
	for _, s := range stats {
		c.received += s.Received
		c.fallbacks += s.Fallbacks
	}
	return c, nil
}

// processCPU is a process's user + system CPU time in seconds, from
// /proc (0 if unreadable).
func processCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / clockTicks
}

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat times: 100 on
// every Linux architecture Go supports.
const clockTicks = 100

// fleetRates are a window's rates, per second.
type fleetRates struct {
	queries, routerQueries     []float64
	cmds, pubs, deliveries     float64
	redisCPU, routersCPU, self float64 // percent of one core
}

func perSecond(a, b fleetCounters) fleetRates {
	secs := b.at.Sub(a.at).Seconds()
	r := fleetRates{
		cmds: float64(b.redisCmds-a.redisCmds) / secs, pubs: float64(b.publishes-a.publishes) / secs,
		deliveries: float64(b.received-a.received) / secs, redisCPU: 100 * (b.redisCPU - a.redisCPU) / secs,
		routersCPU: 100 * (b.routersCPU - a.routersCPU) / secs, self: 100 * (b.selfCPU - a.selfCPU) / secs,
	}
	for i := range a.queries {
		r.queries = append(r.queries, float64(b.queries[i]-a.queries[i])/secs)
		r.routerQueries = append(r.routerQueries, float64(b.routerQueries[i]-a.routerQueries[i])/secs)
	}
	return r
}

// row runs one configuration: n routers on the feed or polling.
func (e *fleetEnv) row(ctx context.Context, mode string, n int) (r fleetRow) {
	r = fleetRow{Mode: mode, Routers: n, Outcomes: map[string]int{}}
	began := time.Now()
	defer func() {
		e.out.say("%s N=%d done in %s", mode, n, time.Since(began).Round(time.Second))
	}()
	fail := func(err error) fleetRow {
		r.Err = err.Error()
		e.keepLogs = true
		e.out.say("%s N=%d: %v", mode, n, err)
		return r
	}
	k := (n + e.o.perProcess - 1) / e.o.perProcess
	r.Processes = k
	s0, err := e.sessions(ctx)
	if err != nil {
		return fail(err)
	}
	logs0 := e.replicaLogSizes()
	defer func() { r.Refused = e.refused(logs0) }()
	var ws []*fleetWorkerProc
	defer func() {
		for _, w := range ws {
			w.stop()
		}
	}()
	for i := range k {
		w, err := e.spawn(i, n/k+btoi(i < n%k))
		if err != nil {
			return fail(err)
		}
		ws = append(ws, w)
	}
	var reps []fleetDSN
	for _, nd := range e.cluster.Replicas() {
		reps = append(reps, fleetDSN{Name: nd.Name(), DSN: nd.DSN(e.db)})
	}
	// -batch is across the workers: every router starting polls the
	// primary once (and, polling by itself, every replica), which costs
	// each such node a connection.
	cfg := fleetWorkerConfig{Primary: e.cluster.Primary().DSN(e.db), Replicas: reps, Redis: e.redis.Addr(),
		Keys: e.keyText, Budget: e.o.budget, Batch: max(1, e.o.batch/k)}
	if mode == "feed" {
		cfg.Feed = e.feed
	}
	e.out.say("%s N=%d: starting the routers in %d worker process(es)", mode, n, k)
	for _, w := range ws {
		c := cfg
		c.Routers = w.n
		if err := w.send(fleetCommand{Op: "start", Config: &c}); err != nil {
			return fail(err)
		}
	}
	for _, w := range ws {
		if _, err := w.recv("started", 15*time.Minute); err != nil {
			return fail(err)
		}
	}
	e.out.say("%s N=%d: routers up in %s; measuring idle for %s", mode, n, time.Since(began).Round(100*time.Millisecond), e.o.idle)
	c0, err := e.counters(ctx, ws)
	if err != nil {
		return fail(err)
	}
	sleepCtx(ctx, e.o.idle)
	c1, err := e.counters(ctx, ws)
	if err != nil {
		return fail(err)
	}
	idle := perSecond(c0, c1)
	r.QueriesIdle, r.RedisCmds, r.Publishes, r.Deliveries = idle.queries, idle.cmds, idle.pubs, idle.deliveries
	r.RouterQueriesIdle = idle.routerQueries
	r.RedisCPU, r.RoutersCPU, r.PublishersCPU = idle.redisCPU, idle.routersCPU, idle.self
	s1, err := e.sessions(ctx)
	if err != nil {
		return fail(err)
	}
	r.StartSessions = minus(s1, s0)

	// Every router's first job reads its snapshot: on the feed, the
	// routers identify their replicas now, not at start.
	e.out.say("%s N=%d: every router's first job", mode, n)
	first := time.Now()
	if _, err := all(ws, fleetCommand{Op: "first"}, "first", 5*time.Minute); err != nil {
		return fail(fmt.Errorf("first jobs: %w", err))
	}
	r.FirstJobsMs = ms(time.Since(first))
	sleepCtx(ctx, 1500*time.Millisecond) // backends flush their session counts within a second
	s2, err := e.sessions(ctx)
	if err != nil {
		return fail(err)
	}
	r.FirstJobSessions = minus(s2, s1)
	// The waiting window starts once the first jobs are done: their
	// identification is in the column above, not in the status load.
	c1, err = e.counters(ctx, ws)
	if err != nil {
		return fail(err)
	}

	e.out.say("%s N=%d: %d catch-up trials", mode, n, e.o.trials)
	var lat, pubLat []time.Duration
	for t := range e.o.trials {
		l, pl, err := e.trial(ctx, ws, &r)
		if err != nil {
			return fail(fmt.Errorf("trial %d: %w", t+1, err))
		}
		lat, pubLat = append(lat, l...), append(pubLat, pl...)
	}
	c2, err := e.counters(ctx, ws)
	if err != nil {
		return fail(err)
	}
	waiting := perSecond(c1, c2)
	r.QueriesWaiting, r.RouterQueriesWaiting = waiting.queries, waiting.routerQueries
	r.Samples = len(lat)
	r.WakeP50, r.WakeP99 = ms(latency.Percentile(lat, 0.5)), ms(latency.Percentile(lat, 0.99))
	r.PubWakeP50, r.PubWakeP99 = ms(latency.Percentile(pubLat, 0.5)), ms(latency.Percentile(pubLat, 0.99))

	e.out.say("%s N=%d: %s lag spike, %.0f Sticky jobs/s across the routers", mode, n, e.o.spike, e.o.spikeRate)
	if err := e.lagSpike(ctx, ws, &r); err != nil {
		return fail(fmt.Errorf("lag spike: %w", err))
	}
	c3, err := e.counters(ctx, ws)
	if err != nil {
		return fail(err)
	}
	r.Fallbacks = c3.fallbacks - c0.fallbacks
	return r
}

// sessions is, per replica, pg_stat_database.sessions of the fleet's
// database: every connection its server accepted, counted when the
// backend reports (at once for one that exits, within a second or so for
// one that stays).
func (e *fleetEnv) sessions(ctx context.Context) ([]int64, error) {
	var out []int64
	for _, c := range e.stats {
		var n int64
		if err := c.QueryRow(ctx, "SELECT sessions FROM pg_stat_database WHERE datname = $1", e.db).Scan(&n); err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// replicaLogSizes are the replicas' server logs' sizes now, for refused.
func (e *fleetEnv) replicaLogSizes() []int64 {
	var out []int64
	for _, n := range e.cluster.Replicas() {
		var size int64
		if st, err := os.Stat(n.LogPath()); err == nil {
			size = st.Size()
		}
		out = append(out, size)
	}
	return out
}

// refused counts, per replica, the connections its log says it refused
// for max_connections since the sizes from.
func (e *fleetEnv) refused(from []int64) []int64 {
	out := make([]int64, len(from))
	for i, n := range e.cluster.Replicas() {
		f, err := os.Open(n.LogPath())
		if err != nil {
			continue
		}
		if _, err := f.Seek(from[i], io.SeekStart); err == nil {
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				if strings.Contains(sc.Text(), "too many clients already") {
					out[i]++
				}
			}
		}
		_ = f.Close()
	}
	return out
}

func minus(b, a []int64) []int64 {
	out := make([]int64, len(b))
	for i := range b {
		out[i] = b[i]
		if i < len(a) {
			out[i] -= a[i]
		}
	}
	return out
}

func fmtCounts(v []int64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.FormatInt(x, 10)
	}
	return strings.Join(s, ", ")
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// write commits a row on the primary and returns the token of the write.
func (e *fleetEnv) write(ctx context.Context) (position.Token, error) {
	wctx, err := enqueue.InTx(ctx, e.primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO items (id, v) VALUES (1, 1) ON CONFLICT (id) DO UPDATE SET v = items.v + 1`)
		return err
	})
	if err != nil {
		return position.Token{}, err
	}
	tok, ok := enqueue.TokenFrom(wctx)
	if !ok {
		return position.Token{}, errors.New("no token after the write")
	}
	return tok, nil
}

// pauseReplicas pauses (and waits until paused) or resumes replay on
// both replicas at once, on the control connections.
func (e *fleetEnv) pauseReplicas(ctx context.Context, pause bool) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	errs := make([]error, len(e.ctrl))
	var wg sync.WaitGroup
	for i, c := range e.ctrl {
		wg.Go(func() {
			if !pause {
				_, errs[i] = c.Exec(ctx, "SELECT pg_wal_replay_resume()")
				return
			}
			// Not abandoned midway, which would close the connection the
			// resume needs.
			if errs[i] = pgtest.RequestReplayPause(ctx, c); errs[i] != nil {
				return
			}
			for state := ""; state != "paused"; {
				if errs[i] = c.QueryRow(ctx, "SELECT pg_get_wal_replay_pause_state()").Scan(&state); errs[i] != nil {
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// trial: replay paused, a write, one Delayed job per router waiting for
// its token, replay resumed; the latencies from the replica passing the
// token (probe) and from the first publisher read showing it.
func (e *fleetEnv) trial(ctx context.Context, ws []*fleetWorkerProc, r *fleetRow) (lat, pubLat []time.Duration, err error) {
	if err := e.pauseReplicas(ctx, true); err != nil {
		return nil, nil, err
	}
	defer func() { _ = e.pauseReplicas(context.Background(), false) }()
	tok, err := e.write(ctx)
	if err != nil {
		return nil, nil, err
	}
	text, err := tok.Encode()
	if err != nil {
		return nil, nil, err
	}
	rctx, stopRec := context.WithCancel(ctx)
	recs := make([][]*replay.Snapshot, len(e.pubs))
	var recWG sync.WaitGroup
	for i, p := range e.pubs {
		recWG.Go(func() {
			s := p.Snapshot()
			for {
				recs[i] = append(recs[i], s)
				select {
				case <-s.Changed():
					s = p.Snapshot()
				case <-rctx.Done():
					return
				}
			}
		})
	}
	defer func() { stopRec(); recWG.Wait() }()
	if _, err := all(ws, fleetCommand{Op: "wait", Token: text}, "waiting", time.Minute); err != nil {
		return nil, nil, err
	}
	// Let every job reach its wait (and, polling by itself, its router
	// start watching the replicas).
	sleepCtx(ctx, 100*time.Millisecond)
	want := tok.Entries[0].LSN
	passed := make([]time.Time, len(e.probes))
	var probes sync.WaitGroup
	pctx, stopProbes := context.WithTimeout(ctx, time.Minute)
	defer stopProbes()
	for i, c := range e.probes {
		probes.Go(func() {
			for pctx.Err() == nil {
				var s string
				sent := time.Now()
				if c.QueryRow(pctx, "SELECT pg_last_wal_replay_lsn()::text").Scan(&s) != nil {
					return
				}
				if l, err := position.ParseLSN(s); err == nil && l >= want {
					passed[i] = sent.Add(time.Since(sent) / 2)
					return
				}
			}
		})
	}
	if err := e.pauseReplicas(ctx, false); err != nil {
		return nil, nil, err
	}
	woke, err := collect(ws, "woke", 2*time.Minute)
	probes.Wait()
	if err != nil {
		return nil, nil, err
	}
	var first time.Time
	for _, p := range passed {
		if !p.IsZero() && (first.IsZero() || p.Before(first)) {
			first = p
		}
	}
	if first.IsZero() {
		return nil, nil, errors.New("the probe never saw a replica pass the token")
	}
	stopRec()
	recWG.Wait()
	var pubRead time.Time
	for _, snaps := range recs {
		if cu, ok := catchup.FirstCaughtUp(tok, snaps, nil); ok && (pubRead.IsZero() || cu.Read.Before(pubRead)) {
			pubRead = cu.Read
		}
	}
	for _, w := range woke {
		for o, n := range w.Outcomes {
			r.Outcomes[o] += n
		}
		for _, at := range w.Woke {
			t := time.Unix(0, at)
			lat = append(lat, max(t.Sub(first), 0))
			if !pubRead.IsZero() {
				pubLat = append(pubLat, max(t.Sub(pubRead), 0))
			}
		}
	}
	sleepCtx(ctx, 200*time.Millisecond)
	return lat, pubLat, nil
}

// lagSpike pauses replay for the spike and runs Sticky jobs for a token
// ahead of the replicas on every router.
func (e *fleetEnv) lagSpike(ctx context.Context, ws []*fleetWorkerProc, r *fleetRow) error {
	if err := e.pauseReplicas(ctx, true); err != nil {
		return err
	}
	defer func() { _ = e.pauseReplicas(context.Background(), false) }()
	tok, err := e.write(ctx)
	if err != nil {
		return err
	}
	text, err := tok.Encode()
	if err != nil {
		return err
	}
	res, err := all(ws, fleetCommand{Op: "spike", Token: text, RatePerRouter: e.o.spikeRate / float64(r.Routers), Duration: e.o.spike},
		"spiked", e.o.spike+5*time.Minute)
	if err != nil {
		return err
	}
	var admitted, shadow []time.Time
	r.SpikeBudgetCalls = map[string]int64{}
	for _, s := range res {
		for _, at := range s.Admitted {
			admitted = append(admitted, time.Unix(0, at))
		}
		for _, at := range s.Shadow {
			shadow = append(shadow, time.Unix(0, at))
		}
		r.SpikeAttempts += s.Attempts
		r.SpikeCapped += s.Capped
		r.SpikeErrors += s.Errors
		for k, v := range s.Budget {
			r.SpikeBudgetCalls[k] += v
		}
	}
	r.SpikeAdmitted = len(admitted)
	r.SpikeMax1s = maxInWindow(admitted, time.Second)
	r.SpikeLimit = e.o.budget.Rate + e.o.budget.Burst
	r.SpikeMean = float64(len(admitted)) / e.o.spike.Seconds()
	r.SpikeLocalMax1s = maxInWindow(shadow, time.Second)
	r.SpikeLocalBound = r.Routers * (int(consume.DefaultPrimaryRate) + consume.DefaultPrimaryBurst)
	if n := r.SpikeBudgetCalls["fleet/unavailable"]; n > 0 {
		r.Notes = append(r.Notes, fmt.Sprintf("%d fleet budget checks were not answered within its %s timeout: those fallbacks were bounded by the routers' own caps alone", n, e.o.budget.Timeout))
	}
	return nil
}

func printFleet(w io.Writer, rows []fleetRow, o fleetOptions) {
	fmt.Fprintf(w, "\n== fleet: routers on a signed position feed (2 publishers every %s) or polling by themselves, one PostgreSQL primary + 2 replicas, one redis-server\n",
		replay.DefaultFeedInterval)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tN\tprocs\treplica connections while routers start (r1, r2)\treplica queries/s idle (r1, r2; routers')\twhile jobs wait\tRedis cmds/s\tPUBLISH/s\tdeliveries/s (of PUBLISH×N)\tCPU: redis, routers, publishers\tcatch-up→wake p50\tp99\tpublisher read→wake p50\tp99\tsamples\trouter fallbacks\t")
	for _, r := range rows {
		pub := func(v float64) string {
			if r.Mode != "feed" {
				return "-"
			}
			return fmtMS(v)
		}
		expected := r.Publishes * float64(r.Routers)
		share := "-"
		if expected > 0 {
			share = fmt.Sprintf("%.0f%%", 100*r.Deliveries/expected)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%.0f\t%.0f\t%.0f (%s)\t%.0f%%, %.0f%%, %.0f%%\t%s\t%s\t%s\t%s\t%d\t%d\t\n", r.Mode, r.Routers, r.Processes,
			fmtCounts(r.StartSessions), fmtQueries(r.QueriesIdle, r.RouterQueriesIdle), fmtQueries(r.QueriesWaiting, r.RouterQueriesWaiting), r.RedisCmds, r.Publishes, r.Deliveries, share, r.RedisCPU, r.RoutersCPU, r.PublishersCPU,
			fmtMS(r.WakeP50), fmtMS(r.WakeP99), pub(r.PubWakeP50), pub(r.PubWakeP99), r.Samples, r.Fallbacks)
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\n   replica connections: what each replica's server counted for the fleet's database (pg_stat_database.sessions), the\n"+
		"   publishers' and this program's own opened before; \"while routers start\" runs from spawning the workers to the end of the\n"+
		"   idle window; \"at first jobs\" is one Snapshot per router (a job's first step: on the feed it has the router identify its\n"+
		"   replicas); \"refused\" counts the replica log's \"too many clients already\" over the whole row (max_connections 200)\n")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tN\twhile routers start (r1, r2)\tat first jobs\tfirst jobs identified in\trefused (too many clients)\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t\n", r.Mode, r.Routers, fmtCounts(r.StartSessions), fmtCounts(r.FirstJobSessions), fmtMS(r.FirstJobsMs), fmtCounts(r.Refused))
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\n   lag spike: replay paused for %s, %.0f Sticky jobs/s across the routers; fleet budget %d/s burst %d (timeout %s); per router cap %v/s burst %d\n",
		o.spike, o.spikeRate, o.budget.Rate, o.budget.Burst, o.budget.Timeout, consume.DefaultPrimaryRate, consume.DefaultPrimaryBurst)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tN\tjobs\tfallback reads\tper s\tmax in 1s (budget+burst)\tcapped\tper-router caps alone: max in 1s (bound)\tbudget checks\t")
	for _, r := range rows {
		if r.SpikeAttempts == 0 {
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.0f\t%d (%d)\t%d\t%d (%d)\t%s\t\n", r.Mode, r.Routers, r.SpikeAttempts, r.SpikeAdmitted, r.SpikeMean,
			r.SpikeMax1s, r.SpikeLimit, r.SpikeCapped, r.SpikeLocalMax1s, r.SpikeLocalBound, sortedCounts(r.SpikeBudgetCalls))
	}
	_ = tw.Flush()
	for _, r := range rows {
		for _, n := range r.Notes {
			fmt.Fprintf(w, "   note (%s N=%d): %s\n", r.Mode, r.Routers, n)
		}
		if len(r.Outcomes) > 0 {
			fmt.Fprintf(w, "   wake outcomes (%s N=%d): %v\n", r.Mode, r.Routers, r.Outcomes)
		}
		if r.Err != "" {
			fmt.Fprintf(w, "   FAIL (%s N=%d): %s\n", r.Mode, r.Routers, r.Err)
		}
	}
}

// fmtQueries is "all, all; routers', routers'" per replica.
func fmtQueries(all, routers []float64) string {
	return fmtRates(all) + "; " + fmtRates(routers)
}

func fmtRates(v []float64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.FormatFloat(x, 'f', 0, 64)
	}
	return strings.Join(s, ", ")
}

// counterSums sums an Int64 counter's data points by the values of attrs
// ("a/b" keys; "" with no attrs).
func counterSums(reader *sdkmetric.ManualReader, name string, attrs ...string) map[string]int64 {
	out := map[string]int64{}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		return out
	}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			s, ok := mt.Data.(metricdata.Sum[int64])
			if mt.Name != name || !ok {
				continue
			}
			for _, dp := range s.DataPoints {
				var parts []string
				for _, a := range attrs {
					v, _ := dp.Attributes.Value(attribute.Key(a))
					parts = append(parts, v.Emit())
				}
				out[strings.Join(parts, "/")] += dp.Value
			}
		}
	}
	return out
}
