package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// errPortInUse marks a start that lost the race for its port; only a fresh
// node, which has no port yet, may retry on another one.
var errPortInUse = errors.New("pgtest: port already in use")

// Node is one PostgreSQL server of a Cluster.
type Node struct {
	c       *Cluster
	name    string
	dir     string // node dir: data dir + log, owned by the service user
	dataDir string
	logPath string

	opMu sync.Mutex // serialises Start/Stop/Kill

	mu      sync.Mutex
	port    int
	hold    int // socket reserving port while the server is down, or -1
	proc    *testsvc.Process
	retired bool // old primary after Promote
}

// Name is "primary", "replica1", … and does not change on Promote.
func (n *Node) Name() string { return n.name }

// Port is the loopback TCP port; a restarted node keeps it.
func (n *Node) Port() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.port
}

// Dir is the node's data directory.
func (n *Node) Dir() string { return n.dataDir }

// LogPath is the server log, useful in failure messages.
func (n *Node) LogPath() string { return n.logPath }

// DSN is a pgx/libpq URL for database ("" means "postgres").
func (n *Node) DSN(database string) string {
	if database == "" {
		database = "postgres"
	}
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", n.Port(), url.PathEscape(database))
}

// Pool opens a pool on this node. Cluster.Close closes it if the caller has
// not.
func (n *Node) Pool(ctx context.Context, database string) (*pgxpool.Pool, error) {
	pool, err := pgxpool.New(ctx, n.DSN(database))
	if err != nil {
		return nil, fmt.Errorf("pgtest: pool for %s: %w", n.name, err)
	}
	n.c.mu.Lock()
	defer n.c.mu.Unlock()
	if n.c.closed {
		pool.Close()
		return nil, errClosed
	}
	n.c.pools = append(n.c.pools, pool)
	return pool, nil
}

// Running reports whether the postmaster is alive.
func (n *Node) Running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.proc != nil && !n.proc.Exited()
}

func (n *Node) current() *testsvc.Process {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.proc
}

func (n *Node) isReplica() bool {
	n.mu.Lock()
	retired := n.retired
	n.mu.Unlock()
	return !retired && n.c.Primary() != n
}

func (n *Node) connect(ctx context.Context, database string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(n.DSN(database))
	if err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	cfg.ConnectTimeout = 5 * time.Second
	cfg.RuntimeParams["application_name"] = "pgtest"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("pgtest: connect to %s (:%d): %w", n.name, n.Port(), err)
	}
	return conn, nil
}

// startFresh starts a node that has no port yet, picking a new one if the
// chosen port is taken before postgres binds it.
func (n *Node) startFresh(ctx context.Context) error {
	var err error
	for range 5 {
		port, fd, perr := testsvc.PickPort()
		if perr != nil {
			return perr
		}
		n.mu.Lock()
		testsvc.UnholdPort(&n.hold)
		n.hold = fd
		n.mu.Unlock()
		if err = n.startOn(ctx, port); !errors.Is(err, errPortInUse) {
			return err
		}
		n.c.logf("%s: port %d taken, retrying", n.name, port)
	}
	return err
}

// startOn runs the postmaster in the foreground as our child, so we own its
// PID, and waits until it accepts connections.
func (n *Node) startOn(ctx context.Context, port int) error {
	if n.c.isClosed() {
		return errClosed
	}
	offset := testsvc.FileSize(n.logPath)
	lf, err := os.OpenFile(n.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	cmd, err := serviceCmd(n.dataDir, "postgres", "-D", n.dataDir, "-p", strconv.Itoa(port), "-c", "cluster_name="+n.name)
	if err != nil {
		_ = lf.Close()
		return err
	}
	cmd.Stdout, cmd.Stderr = lf, lf
	n.mu.Lock()
	testsvc.UnholdPort(&n.hold)
	n.mu.Unlock()
	p, err := testsvc.Spawn(cmd)
	_ = lf.Close()
	if err != nil {
		n.afterExit(true)
		return fmt.Errorf("pgtest: start postgres for %s: %w; %s", n.name, err, installHint)
	}
	n.c.sb.RecordPID(n.name, p.PID())
	n.mu.Lock()
	n.proc, n.port = p, port
	n.mu.Unlock()
	if err := n.waitReady(ctx, p, offset); err != nil {
		killTree(p)
		n.afterExit(!errors.Is(err, errPortInUse))
		return err
	}
	return nil
}

func (n *Node) waitReady(ctx context.Context, p *testsvc.Process, logOffset int64) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, time.Minute)
	defer cancel()
	for {
		if p.Exited() {
			tail := testsvc.LogTail(n.logPath, logOffset)
			if strings.Contains(tail, "Address already in use") || strings.Contains(tail, "could not bind") {
				return fmt.Errorf("%w: %s :%d", errPortInUse, n.name, n.Port())
			}
			return fmt.Errorf("pgtest: postgres %s exited during startup (%v); log %s:\n%s", n.name, p.Err(), n.logPath, tail)
		}
		cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := n.connect(cctx, "")
		ccancel()
		if err == nil {
			_ = conn.Close(ctx)
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("pgtest: postgres %s not accepting connections: %v; log %s:\n%s", n.name, err, n.logPath, testsvc.LogTail(n.logPath, logOffset))
		}
		time.Sleep(15 * time.Millisecond)
	}
}

// afterExit tidies up once the postmaster is gone. A clean shutdown removes
// postmaster.pid itself; if it is still there the postmaster was killed, and
// its SysV segment would otherwise leak and its lock file could name a PID
// that a stranger reuses by the next Start. With reserve the port is held
// until the next Start.
func (n *Node) afterExit(reserve bool) {
	n.c.sb.ForgetPID(n.name)
	n.mu.Lock()
	if reserve && n.hold < 0 && n.port != 0 {
		n.hold, _ = testsvc.HoldPort(n.port)
	}
	n.mu.Unlock()
	if _, err := os.Stat(filepath.Join(n.dataDir, "postmaster.pid")); err == nil {
		freeSharedMemory(n.dataDir)
		_ = os.Remove(filepath.Join(n.dataDir, "postmaster.pid"))
	}
}

// Start restarts a stopped or killed node with the same data dir and port.
// It returns once the node accepts connections and, for a replica whose
// primary is running, once it is streaming again.
func (n *Node) Start(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, time.Minute)
	defer cancel()
	started, err := n.startStopped(ctx)
	if err != nil || !started {
		return err
	}
	if n.isReplica() && n.c.Primary().Running() {
		return n.waitStreaming(ctx, 0, -1)
	}
	return nil
}

// startStopped starts the node on its port unless it runs; started says
// whether it did. A retired primary is refused.
func (n *Node) startStopped(ctx context.Context) (started bool, err error) {
	n.mu.Lock()
	retired := n.retired
	n.mu.Unlock()
	if retired {
		return false, fmt.Errorf("pgtest: %s was the primary before a promotion; its history has diverged and it cannot be started again", n.name)
	}
	n.opMu.Lock()
	defer n.opMu.Unlock()
	if n.Running() {
		return false, nil
	}
	return true, n.startOn(ctx, n.Port())
}

// Stop shuts the node down in "fast" mode (SIGINT): sessions are cut, a
// shutdown checkpoint is written, and a primary's walsenders first send all
// WAL to connected standbys. If ctx ends first the node is killed.
func (n *Node) Stop(ctx context.Context) error {
	n.opMu.Lock()
	defer n.opMu.Unlock()
	p := n.current()
	if p.Exited() {
		if p != nil {
			n.afterExit(true) // it died on its own: tidy up as after a kill
		}
		return nil
	}
	_ = syscall.Kill(p.PID(), syscall.SIGINT)
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, time.Minute)
	defer cancel()
	select {
	case <-p.Done():
		n.afterExit(true)
		return nil
	case <-ctx.Done():
		killTree(p)
		n.afterExit(true)
		return fmt.Errorf("pgtest: %s did not stop in time and was killed: %w", n.name, ctx.Err())
	}
}

// Kill SIGKILLs the postmaster and its children, as a crash would, and waits
// until they are gone. The next Start runs crash recovery.
func (n *Node) Kill() error {
	n.opMu.Lock()
	defer n.opMu.Unlock()
	p := n.current()
	if p.Exited() {
		if p != nil {
			n.afterExit(true) // it died on its own: tidy up as after a kill
		}
		return nil
	}
	killTree(p)
	if !p.Exited() {
		return fmt.Errorf("pgtest: %s (pid %d) survived SIGKILL", n.name, p.PID())
	}
	n.afterExit(true)
	return nil
}

// shutdownForClose uses an immediate shutdown: nothing needs to be durable
// and it is the fastest way that still releases shared memory.
func (n *Node) shutdownForClose() {
	n.opMu.Lock()
	defer n.opMu.Unlock()
	defer func() {
		n.mu.Lock()
		testsvc.UnholdPort(&n.hold)
		n.mu.Unlock()
	}()
	p := n.current()
	if p.Exited() {
		return
	}
	_ = syscall.Kill(p.PID(), syscall.SIGQUIT)
	if !p.Wait(10 * time.Second) {
		killTree(p)
	}
	n.afterExit(false)
}

// cloneFrom makes this node a streaming replica of src from a base backup
// (baseBackup, through the slot named after the node) and starts it (on a
// new port if it has none yet).
func (n *Node) cloneFrom(ctx context.Context, src *Node) error {
	t0 := time.Now()
	if err := baseBackup(ctx, src, n.dataDir, n.name); err != nil {
		if n.c.isClosed() {
			return errClosed
		}
		return fmt.Errorf("pgtest: making %s: %w", n.name, err)
	}
	n.c.logf("base backup of %s for %s took %v", src.name, n.name, time.Since(t0).Round(time.Millisecond))
	if err := n.writeStandbyConf(src); err != nil {
		return err
	}
	var err error
	n.opMu.Lock()
	if n.Port() == 0 {
		err = n.startFresh(ctx)
	} else {
		err = n.startOn(ctx, n.Port())
	}
	n.opMu.Unlock()
	if err != nil {
		return err
	}
	return n.waitStreaming(ctx, 0, -1)
}

// writeStandbyConf points this replica at primary. It edits only the
// replication lines of postgresql.auto.conf and works whether or not the
// node is running (a running one needs a reload).
func (n *Node) writeStandbyConf(primary *Node) error {
	if err := n.editAutoConf(map[string]string{
		"primary_conninfo":  fmt.Sprintf("'host=127.0.0.1 port=%d user=postgres application_name=%s'", primary.Port(), n.name),
		"primary_slot_name": "'" + n.name + "'",
	}); err != nil {
		return err
	}
	signal := filepath.Join(n.dataDir, "standby.signal")
	if _, err := os.Stat(signal); err != nil {
		if err := writeServiceFile(signal, nil); err != nil {
			return fmt.Errorf("pgtest: %w", err)
		}
	}
	return nil
}

// errDiverged: the replica has WAL the new primary's history does not
// contain; only a fresh base backup can make it a standby again.
var errDiverged = errors.New("pgtest: replica's WAL has diverged from the new primary's timeline")

// divergenceMessages are what PostgreSQL 15 logs when a standby cannot
// follow a timeline switch.
var divergenceMessages = []string{
	"forked off current database system timeline",
	"is not in this server's history",
	"of the primary is behind recovery timeline",
}

// waitStreaming waits until the WAL receiver streams, on timeline minTLI or
// later. With logFrom >= 0 it gives up early with errDiverged when the log
// written since that offset says the node cannot follow.
func (n *Node) waitStreaming(ctx context.Context, minTLI uint32, logFrom int64) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	var last string
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			_ = conn.Close(context.Background())
		}
	}()
	for {
		if conn == nil {
			c, err := n.connect(ctx, "")
			if err != nil {
				last = err.Error()
			}
			conn = c
		}
		if conn != nil {
			var status string
			var tli int64
			err := conn.QueryRow(ctx, "SELECT status, coalesce(received_tli, 0) FROM pg_stat_wal_receiver").Scan(&status, &tli)
			switch {
			case errors.Is(err, pgx.ErrNoRows):
				last = "no WAL receiver"
			case err != nil:
				last = err.Error()
				_ = conn.Close(ctx)
				conn = nil
			case status == "streaming" && uint32(tli) >= minTLI:
				return nil
			default:
				last = fmt.Sprintf("status %s, timeline %d", status, tli)
			}
		}
		if !n.Running() {
			return fmt.Errorf("pgtest: %s stopped while waiting for streaming; log %s:\n%s", n.name, n.logPath, testsvc.LogTail(n.logPath, 0))
		}
		if logFrom >= 0 {
			tail := testsvc.LogTail(n.logPath, logFrom)
			for _, m := range divergenceMessages {
				if strings.Contains(tail, m) {
					return fmt.Errorf("%w: %s", errDiverged, n.name)
				}
			}
		}
		if err := testsvc.SleepCtx(ctx, 20*time.Millisecond); err != nil {
			return fmt.Errorf("pgtest: %s is not streaming (want timeline >= %d; last: %s); log %s:\n%s", n.name, minTLI, last, n.logPath, testsvc.LogTail(n.logPath, 0))
		}
	}
}

// follow re-points a replica at a newly promoted primary: reload first (a
// WAL receiver picks up a new primary_conninfo without a restart since
// PostgreSQL 13), then restart, then rebuild from a fresh base backup, which
// is the only way back for a replica that had WAL past the switchpoint
// (possible only if the old primary crashed instead of being stopped).
func (n *Node) follow(ctx context.Context, primary *Node, tli uint32) error {
	if err := n.writeStandbyConf(primary); err != nil {
		return err
	}
	if !n.Running() {
		return nil
	}
	attempt := func(logFrom int64) error {
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return n.waitStreaming(actx, tli, logFrom)
	}
	logFrom := testsvc.FileSize(n.logPath)
	err := n.Exec(ctx, "", "SELECT pg_reload_conf()")
	if err == nil {
		if err = attempt(logFrom); err == nil {
			return nil
		}
	}
	if !errors.Is(err, errDiverged) {
		n.c.logf("%s did not follow %s after reload (%v); restarting", n.name, primary.name, err)
		logFrom = testsvc.FileSize(n.logPath)
		if err = n.Stop(ctx); err == nil {
			n.opMu.Lock()
			err = n.startOn(ctx, n.Port())
			n.opMu.Unlock()
			if err == nil {
				if err = attempt(logFrom); err == nil {
					return nil
				}
			}
		}
	}
	n.c.logf("%s cannot follow %s (%v); rebuilding it from a base backup", n.name, primary.name, err)
	if err := n.Stop(ctx); err != nil {
		return err
	}
	if err := os.RemoveAll(n.dataDir); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return n.cloneFrom(ctx, primary)
}

// Follow re-points this replica at primary, the cluster's current
// primary (after PromoteAlone, say): its slot is created there, then the
// replica reloads, restarts or, if it has diverged (replayed past the
// switchpoint of primary's timeline), is rebuilt from a fresh base backup.
// It returns once the replica streams on primary's timeline.
func (n *Node) Follow(ctx context.Context, primary *Node) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 2*time.Minute)
	defer cancel()
	if primary != n.c.Primary() {
		return fmt.Errorf("pgtest: Follow: %s is not the cluster's primary", primary.name)
	}
	if !n.isReplica() {
		return fmt.Errorf("pgtest: Follow: %s is not a replica", n.name)
	}
	if err := primary.ensureSlot(ctx, n.name); err != nil {
		return err
	}
	tli, err := primary.Timeline(ctx)
	if err != nil {
		return err
	}
	return n.follow(ctx, primary, tli)
}

// ensureSlot creates the physical replication slot name on n if missing.
func (n *Node) ensureSlot(ctx context.Context, name string) error {
	return n.Exec(ctx, "", "SELECT pg_create_physical_replication_slot($1, true) WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)", name)
}

// editAutoConf rewrites postgresql.auto.conf with settings: every line
// that sets one of them goes, then each non-empty one is appended (sorted,
// so that the file is the same from run to run); the other lines stay.
func (n *Node) editAutoConf(settings map[string]string) error {
	path := filepath.Join(n.dataDir, "postgresql.auto.conf")
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("pgtest: %w", err)
	}
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimRight(string(old), "\n"), "\n") {
		key := strings.TrimSpace(strings.SplitN(line, "=", 2)[0])
		if _, set := settings[key]; set || line == "" {
			continue
		}
		b.WriteString(line + "\n")
	}
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if settings[k] != "" {
			fmt.Fprintf(&b, "%s = %s\n", k, settings[k])
		}
	}
	if err := writeServiceFile(path, []byte(b.String())); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return nil
}

// SetConf sets postgresql.conf parameters for this node in its
// postgresql.auto.conf (an empty value removes the line), as ALTER SYSTEM
// would, but also while the node is stopped. A running node reloads its
// configuration; parameters that need a restart take effect at the next
// Start. Values are written verbatim: quote strings as postgresql.conf
// wants them, e.g. {"recovery_min_apply_delay": "'1h'"}.
func (n *Node) SetConf(ctx context.Context, settings map[string]string) error {
	if err := n.editAutoConf(settings); err != nil {
		return err
	}
	if n.Running() {
		return n.Exec(ctx, "", "SELECT pg_reload_conf()")
	}
	return nil
}

// StartAccepting is Start without waiting for the WAL receiver: it
// returns as soon as the node accepts connections. A replica restarted
// with recovery_min_apply_delay (SetConf), for one, replays what it has
// locally up to its first delayed commit and does not start streaming
// until it needs more WAL.
func (n *Node) StartAccepting(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, time.Minute)
	defer cancel()
	_, err := n.startStopped(ctx)
	return err
}

// Exec runs sql in database ("" = "postgres") on its own short-lived
// connection.
func (n *Node) Exec(ctx context.Context, database, sql string, args ...any) error {
	conn, err := n.connect(ctx, database)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		return fmt.Errorf("pgtest: %s: %s: %w", n.name, sql, err)
	}
	return nil
}

func queryRow[T any](ctx context.Context, n *Node, sql string, args ...any) (T, error) {
	var v T
	conn, err := n.connect(ctx, "")
	if err != nil {
		return v, err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	if err := conn.QueryRow(ctx, sql, args...).Scan(&v); err != nil {
		return v, fmt.Errorf("pgtest: %s: %s: %w", n.name, sql, err)
	}
	return v, nil
}

// InRecovery reports pg_is_in_recovery().
func (n *Node) InRecovery(ctx context.Context) (bool, error) {
	return queryRow[bool](ctx, n, "SELECT pg_is_in_recovery()")
}

// ReplayLSN is pg_last_wal_replay_lsn() on a replica and
// pg_current_wal_insert_lsn() on a primary, as "X/Y" text.
func (n *Node) ReplayLSN(ctx context.Context) (string, error) {
	lsn, err := queryRow[*string](ctx, n, `SELECT (CASE WHEN pg_is_in_recovery()
		THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END)::text`)
	if err != nil {
		return "", err
	}
	if lsn == nil {
		return "", fmt.Errorf("pgtest: %s has no replay position yet", n.name)
	}
	return *lsn, nil
}

// WaitReplay waits until the node's ReplayLSN is at least lsn ("X/Y").
func (n *Node) WaitReplay(ctx context.Context, lsn string) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := n.connect(ctx, "")
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	for {
		var ok bool
		var at *string
		err := conn.QueryRow(ctx, `SELECT coalesce(p >= $1::pg_lsn, false), p::text FROM (SELECT CASE WHEN pg_is_in_recovery()
			THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END AS p) s`, lsn).Scan(&ok, &at)
		if err != nil {
			return fmt.Errorf("pgtest: %s: waiting for replay of %s: %w", n.name, lsn, err)
		}
		if ok {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 10*time.Millisecond); err != nil {
			pos := "NULL"
			if at != nil {
				pos = *at
			}
			return fmt.Errorf("pgtest: %s has replayed %s, not yet %s: %w", n.name, pos, lsn, err)
		}
	}
}

// SystemIdentifier is pg_control_system().system_identifier, the first half
// of an epoch.
func (n *Node) SystemIdentifier(ctx context.Context) (uint64, error) {
	id, err := queryRow[int64](ctx, n, "SELECT system_identifier FROM pg_control_system()")
	return uint64(id), err
}

// Timeline follows design fact 3: on a primary the timeline of the current
// WAL file name; on a standby the WAL receiver's received_tli, and only
// without a receiver pg_control_checkpoint(), which lags a promotion.
func (n *Node) Timeline(ctx context.Context) (uint32, error) {
	conn, err := n.connect(ctx, "")
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	var rec bool
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&rec); err != nil {
		return 0, fmt.Errorf("pgtest: %s: %w", n.name, err)
	}
	if !rec {
		var walfile string
		if err := conn.QueryRow(ctx, "SELECT pg_walfile_name(pg_current_wal_lsn())").Scan(&walfile); err != nil {
			return 0, fmt.Errorf("pgtest: %s: timeline: %w", n.name, err)
		}
		if len(walfile) < 8 {
			return 0, fmt.Errorf("pgtest: %s: odd WAL file name %q", n.name, walfile)
		}
		tli, err := strconv.ParseUint(walfile[:8], 16, 32)
		return uint32(tli), err
	}
	var tli int64
	err = conn.QueryRow(ctx, "SELECT coalesce(received_tli, 0) FROM pg_stat_wal_receiver").Scan(&tli)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("pgtest: %s: timeline: %w", n.name, err)
	}
	if tli == 0 {
		if err := conn.QueryRow(ctx, "SELECT timeline_id FROM pg_control_checkpoint()").Scan(&tli); err != nil {
			return 0, fmt.Errorf("pgtest: %s: timeline: %w", n.name, err)
		}
	}
	return uint32(tli), nil
}

// PauseReplay pauses WAL replay and waits until it has actually paused
// (pg_wal_replay_pause only requests it).
func (n *Node) PauseReplay(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := n.connect(ctx, "")
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	if err := RequestReplayPause(ctx, conn); err != nil {
		return fmt.Errorf("pgtest: %s: pause replay: %w", n.name, err)
	}
	for {
		var state string
		if err := conn.QueryRow(ctx, "SELECT pg_get_wal_replay_pause_state()").Scan(&state); err != nil {
			return fmt.Errorf("pgtest: %s: pause replay: %w", n.name, err)
		}
		if state == "paused" {
			return nil
		}
		if err := testsvc.SleepCtx(ctx, 5*time.Millisecond); err != nil {
			return fmt.Errorf("pgtest: %s: replay still %q: %w", n.name, state, err)
		}
	}
}

// Execer runs a statement: a *pgx.Conn or a *pgxpool.Pool.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// RequestReplayPause asks the replica db is connected to to pause replay
// at its next record (pg_wal_replay_pause), and returns once the server
// has answered, even if ctx ends meanwhile (up to 30 s). A request
// abandoned on its way can still run on the server after a later
// ResumeReplay and leave replay paused for the tests that come next: a
// test that pauses and resumes replay at random and is stopped in the
// middle of a request (replicatest.ToggleReplay) did that. A ctx that has
// already ended sends nothing.
func RequestReplayPause(ctx context.Context, db Execer) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	_, err := db.Exec(ctx, "SELECT pg_wal_replay_pause()")
	return err
}

// ResumeReplay undoes PauseReplay.
func (n *Node) ResumeReplay(ctx context.Context) error {
	return n.Exec(ctx, "", "SELECT pg_wal_replay_resume()")
}

// HoldQuery opens a REPEATABLE READ transaction on this node (a replica) in
// database and keeps its snapshot until release is called or d has passed
// (d <= 0: until release). While it is held, replay of WAL that would remove
// rows the snapshot may still need waits, up to max_standby_streaming_delay,
// and with it every later record on this replica.
//
// To provoke that conflict: have a table with rows in the same database
// (conflicts are per database), wait until the replica has replayed them,
// HoldQuery, then on the primary DELETE the rows and VACUUM the table. The
// VACUUM's prune record stalls replay here; hot_standby_feedback is off so
// the primary does not know to keep the rows. If the hold outlives
// max_standby_streaming_delay the server ends the session ("conflict with
// recovery") and replay continues; release is still safe to call.
func (n *Node) HoldQuery(ctx context.Context, database string, d time.Duration) (release func(), err error) {
	conn, err := n.connect(ctx, database)
	if err != nil {
		return nil, err
	}
	// The snapshot is taken by the first statement after BEGIN, not by BEGIN.
	if _, err := conn.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ"); err == nil {
		_, err = conn.Exec(ctx, "SELECT count(*) FROM pg_class")
	}
	if err != nil {
		_ = conn.Close(context.Background())
		return nil, fmt.Errorf("pgtest: %s: HoldQuery: %w", n.name, err)
	}
	var mu sync.Mutex
	var timer *time.Timer
	released := false
	release = func() {
		mu.Lock()
		defer mu.Unlock()
		if released {
			return
		}
		released = true
		if timer != nil {
			timer.Stop()
		}
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, _ = conn.Exec(rctx, "ROLLBACK")
		_ = conn.Close(rctx)
	}
	if d > 0 {
		mu.Lock()
		timer = time.AfterFunc(d, release)
		mu.Unlock()
	}
	return release, nil
}
