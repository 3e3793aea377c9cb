package pgtest

import (
	"github.com/caughtup/caughtup/position"

	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// Options configures Start. The zero value is a primary with two replicas.
type Options struct {
	// Replicas is the number of streaming replicas. Default 2 when zero;
	// negative means none.
	Replicas int
	// Settings are extra postgresql.conf settings for every node, applied
	// after (and so overriding) the harness defaults, e.g.
	// {"max_standby_streaming_delay": "5s"}. Values are written verbatim, so
	// quote strings the way postgresql.conf wants them.
	Settings map[string]string
	// Logf receives progress messages (t.Logf fits). Default: discarded.
	Logf func(format string, args ...any)
}

func (o Options) replicas() int {
	switch {
	case o.Replicas == 0:
		return 2
	case o.Replicas < 0:
		return 0
	default:
		return o.Replicas
	}
}

// baseSettings trade durability for speed (the data is thrown away) and make
// replication observable quickly.
var baseSettings = [][2]string{
	{"listen_addresses", "'127.0.0.1'"},
	{"unix_socket_directories", "''"},
	{"max_connections", "200"},
	{"shared_buffers", "32MB"},
	{"fsync", "off"},
	{"full_page_writes", "off"},
	{"wal_level", "logical"},
	{"max_wal_senders", "20"},
	{"max_replication_slots", "20"},
	// Sandboxes usually live in /dev/shm, i.e. RAM: keep WAL bounded. Slots
	// hold WAL for stopped replicas, up to max_slot_wal_keep_size.
	{"wal_keep_size", "128MB"},
	{"max_slot_wal_keep_size", "1GB"},
	{"max_wal_size", "256MB"},
	{"min_wal_size", "32MB"},
	{"hot_standby", "on"},
	// Off so that a replica's snapshots do not hold back VACUUM on the
	// primary: HoldQuery relies on replay conflicts actually happening.
	{"hot_standby_feedback", "off"},
	{"max_standby_streaming_delay", "30s"},
	{"max_standby_archive_delay", "30s"},
	{"wal_receiver_status_interval", "1s"},
	// Default 5s: the time a replica takes to try again after its primary
	// restarted or after Promote re-pointed it.
	{"wal_retrieve_retry_interval", "200ms"},
	// mmap puts dynamic shared memory in <data>/pg_dynshmem instead of
	// /dev/shm/PostgreSQL.*, so a SIGKILLed node's segments go away with its
	// directory rather than leaking until reboot.
	{"dynamic_shared_memory_type", "mmap"},
	{"jit", "off"},
	{"logging_collector", "off"},
	{"log_destination", "'stderr'"},
	{"log_line_prefix", "'%m [%p] %q%u@%d '"},
	{"log_min_messages", "warning"},
	{"log_timezone", "'UTC'"},
	{"huge_pages", "off"},
}

const hbaConf = `# Written by pgtest: loopback only, no passwords.
local all         all                trust
local replication all                trust
host  all         all  127.0.0.1/32  trust
host  replication all  127.0.0.1/32  trust
`

// Cluster is a primary with streaming replicas, all in one temp dir.
type Cluster struct {
	opts       Options
	sb         *testsvc.Sandbox
	unregister func()

	mu       sync.Mutex
	primary  *Node
	replicas []*Node
	retired  []*Node
	pools    []*pgxpool.Pool
	closed   bool
}

func (c *Cluster) logf(format string, args ...any) {
	if c.opts.Logf != nil {
		c.opts.Logf("pgtest: "+format, args...)
	}
}

// Start creates and starts a primary and opts.Replicas streaming replicas
// and returns once every replica is streaming. On error nothing is left
// running.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	began := time.Now()
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 2*time.Minute)
	defer cancel()
	v, err := ServerVersion(ctx)
	if err != nil {
		return nil, err
	}
	sb, err := newSandbox("pgtest-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{opts: opts, sb: sb}
	c.unregister = testsvc.Register(c.Close)
	if err := c.build(ctx); err != nil {
		_ = c.Close()
		return nil, err
	}
	ports := make([]string, 0, len(c.replicas))
	for _, r := range c.replicas {
		ports = append(ports, fmt.Sprintf("%s :%d", r.name, r.Port()))
	}
	c.logf("PostgreSQL %s cluster up in %v: primary :%d, %s (dir %s; binaries from %s)", v, time.Since(began).Round(time.Millisecond), c.primary.Port(), strings.Join(ports, ", "), sb.Root(), v.Origin)
	return c, nil
}

func (c *Cluster) build(ctx context.Context) error {
	p, err := c.newNode("primary")
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.primary = p
	c.mu.Unlock()
	t0 := time.Now()
	out, err := runService(ctx, p.dir, "initdb", "-D", p.dataDir, "-U", "postgres", "--auth=trust",
		"-N", "-E", "UTF8", "--locale=C", "--no-instructions")
	if err != nil {
		if c.isClosed() {
			return errClosed
		}
		return fmt.Errorf("pgtest: initdb failed: %v: %s; %s", err, testsvc.TailLines(string(out), 15), installHint)
	}
	c.logf("initdb took %v", time.Since(t0).Round(time.Millisecond))
	if err := c.writeConf(p.dataDir); err != nil {
		return err
	}
	if err := p.startFresh(ctx); err != nil {
		return err
	}

	n := c.opts.replicas()
	replicas := make([]*Node, n)
	for i := range n {
		if replicas[i], err = c.newNode(fmt.Sprintf("replica%d", i+1)); err != nil {
			return err
		}
	}
	// Listed before they start, so that a Close from the signal handler
	// reaches every process even in the middle of Start.
	c.mu.Lock()
	c.replicas = replicas
	c.mu.Unlock()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, r := range replicas {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = r.cloneFrom(ctx, p)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (c *Cluster) newNode(name string) (*Node, error) {
	dir := filepath.Join(c.sb.Root(), name)
	if err := mkdirService(dir); err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	return &Node{
		c:       c,
		name:    name,
		dir:     dir,
		dataDir: filepath.Join(dir, "data"),
		logPath: filepath.Join(dir, "postgres.log"),
		hold:    -1,
	}, nil
}

func (c *Cluster) writeConf(dataDir string) error {
	var b strings.Builder
	b.WriteString("\n# pgtest settings\n")
	for _, kv := range baseSettings {
		fmt.Fprintf(&b, "%s = %s\n", kv[0], kv[1])
	}
	keys := make([]string, 0, len(c.opts.Settings))
	for k := range c.opts.Settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	if len(keys) > 0 {
		b.WriteString("# Options.Settings\n")
	}
	for _, k := range keys {
		fmt.Fprintf(&b, "%s = %s\n", k, c.opts.Settings[k])
	}
	f, err := os.OpenFile(filepath.Join(dataDir, "postgresql.conf"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	if _, err := f.WriteString(b.String()); err != nil {
		_ = f.Close()
		return fmt.Errorf("pgtest: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	if err := writeServiceFile(filepath.Join(dataDir, "pg_hba.conf"), []byte(hbaConf)); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return nil
}

// Primary returns the current primary; it changes after Promote.
func (c *Cluster) Primary() *Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.primary
}

// Replicas returns the current replicas in creation order.
func (c *Cluster) Replicas() []*Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*Node(nil), c.replicas...)
}

// Nodes returns the primary followed by the replicas.
func (c *Cluster) Nodes() []*Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*Node{c.primary}, c.replicas...)
}

// Dir is the cluster's temporary root directory.
func (c *Cluster) Dir() string { return c.sb.Root() }

// Close stops every node (immediate shutdown: the data is thrown away),
// closes the pools handed out by Node.Pool and removes the temp dir. It is
// idempotent and safe to call concurrently with a signal-triggered close.
func (c *Cluster) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	var nodes []*Node
	if c.primary != nil {
		nodes = append(nodes, c.primary)
	}
	nodes = append(nodes, c.replicas...)
	nodes = append(nodes, c.retired...)
	pools := c.pools
	c.pools = nil
	c.mu.Unlock()

	closePools(pools)
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Add(1)
		go func() { defer wg.Done(); n.shutdownForClose() }()
	}
	wg.Wait()
	err := c.sb.Remove()
	if c.unregister != nil {
		c.unregister()
	}
	return err
}

// closePools closes pools without letting a connection the test never
// released (pgxpool.Close waits for those) hang Close.
func closePools(pools []*pgxpool.Pool) {
	if len(pools) == 0 {
		return
	}
	done := make(chan struct{})
	go func() {
		for _, p := range pools {
			p.Close()
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
	}
}

func (c *Cluster) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// CreateDatabase creates a database on the primary and waits until every
// running replica has replayed it, so the caller can connect to it anywhere.
func (c *Cluster) CreateDatabase(ctx context.Context, name string) error {
	conn, err := c.Primary().connect(ctx, "")
	if err != nil {
		return err
	}
	// FILE_COPY: two cheap checkpoints (fsync is off) instead of WAL-logging
	// all of template1; about twice as fast here, and far less WAL. It is
	// what PostgreSQL < 15 always did, without the keyword.
	sql := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	major, _ := strconv.Atoi(strings.SplitN(conn.PgConn().ParameterStatus("server_version"), ".", 2)[0])
	if major >= 15 {
		sql += " STRATEGY FILE_COPY"
	}
	_, err = conn.Exec(ctx, sql)
	_ = conn.Close(ctx)
	if err != nil {
		return fmt.Errorf("pgtest: create database %q: %w", name, err)
	}
	return c.WaitReplicasCaughtUp(ctx)
}

// WaitReplicasCaughtUp waits until every running replica has replayed up to
// the primary's current insert LSN (the position design fact 1 stamps),
// taken as an end position (position.WALLayout.InsertEnd) so that an idle
// primary whose last record ended on a page boundary does not make it wait
// for the next record. A paused replica makes it wait until ctx is done
// (default 30 s).
func (c *Cluster) WaitReplicasCaughtUp(ctx context.Context) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := c.Primary().connect(ctx, "")
	if err != nil {
		return err
	}
	var insert string
	var layout position.WALLayout
	err = conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text, c.max_data_alignment::int8,
		c.wal_block_size::int8, c.bytes_per_wal_segment::int8 FROM pg_control_init() c`).Scan(&insert, &layout.MaxAlign, &layout.BlockSize, &layout.SegmentSize)
	_ = conn.Close(context.Background())
	if err != nil {
		return fmt.Errorf("pgtest: primary insert position: %w", err)
	}
	lsn, err := position.ParseLSN(insert)
	if err != nil {
		return err
	}
	target := layout.InsertEnd(lsn).String()
	for _, r := range c.Replicas() {
		if !r.Running() {
			continue
		}
		if err := r.WaitReplay(ctx, target); err != nil {
			return err
		}
	}
	return nil
}

// Promote fails over to replica. The old primary is shut down cleanly first:
// a fast shutdown waits until every connected standby has flushed all WAL, so
// no replica is ahead of the one promoted and all of them can follow it.
// Then pg_promote(wait => true) runs on replica, and every other replica is
// re-pointed at it (primary_conninfo rewritten, configuration reloaded; a
// restart, and then a fresh base backup, if that does not get it streaming
// on the new timeline). Stopped replicas are only re-pointed, and follow the
// new primary when started. The old primary stays stopped and leaves Nodes().
func (c *Cluster) Promote(ctx context.Context, replica *Node) error {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 2*time.Minute)
	defer cancel()
	old, err := c.promotable("Promote", replica)
	if err != nil {
		return err
	}
	if err := old.Stop(ctx); err != nil {
		return fmt.Errorf("pgtest: Promote: stopping old primary: %w", err)
	}

	if err := replica.promote(ctx); err != nil {
		return err
	}
	// Slots do not survive promotion; recreate one per follower so the
	// new primary keeps their WAL while they are stopped.
	for _, r := range c.Replicas() {
		if r != replica {
			if err := replica.ensureSlot(ctx, r.name); err != nil {
				return err
			}
		}
	}

	followers := c.installPrimary(old, replica)

	tli, err := replica.Timeline(ctx)
	if err != nil {
		return err
	}
	c.logf("promoted %s (timeline %d)", replica.name, tli)
	var wg sync.WaitGroup
	errs := make([]error, len(followers))
	for i, r := range followers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = r.follow(ctx, replica, tli)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// PromoteAlone promotes replica without touching anything else: the old
// primary keeps running and accepting writes, and every other replica
// keeps following it. This is the split a failover leaves when the old
// primary was not fenced: a standby still streaming from it replays, past
// the new timeline's switchpoint, writes that the new primary never had
// (a diverged standby). Promote is the clean switchover.
//
// Afterwards Primary() is replica and the old primary leaves Nodes() but
// keeps running until Close (it is returned, so that the caller can write
// on it); Replicas() still lists the others, on the old timeline, and
// WaitReplicasCaughtUp would wait for them in vain. Node.Follow re-points
// one of them at the new primary.
func (c *Cluster) PromoteAlone(ctx context.Context, replica *Node) (oldPrimary *Node, err error) {
	ctx, cancel := testsvc.WithDefaultTimeout(ctx, 2*time.Minute)
	defer cancel()
	old, err := c.promotable("PromoteAlone", replica)
	if err != nil {
		return nil, err
	}
	if err := replica.promote(ctx); err != nil {
		return nil, err
	}
	c.installPrimary(old, replica)
	tli, err := replica.Timeline(ctx)
	if err != nil {
		return nil, err
	}
	c.logf("promoted %s alone (timeline %d); %s still runs on the old timeline", replica.name, tli, old.name)
	return old, nil
}

// promotable checks that replica is a running replica of c, for op
// (Promote, PromoteAlone), and returns the current primary.
func (c *Cluster) promotable(op string, replica *Node) (old *Node, err error) {
	c.mu.Lock()
	old = c.primary
	found := slices.Contains(c.replicas, replica)
	c.mu.Unlock()
	if !found {
		return nil, fmt.Errorf("pgtest: %s: %s is not a replica of this cluster", op, replica.Name())
	}
	if !replica.Running() {
		return nil, fmt.Errorf("pgtest: %s: %s is not running", op, replica.name)
	}
	return old, nil
}

// installPrimary records that replica, now promoted, is the primary and
// that old is retired: it can no longer be started, since its history has
// diverged. It returns the remaining replicas.
func (c *Cluster) installPrimary(old, replica *Node) (replicas []*Node) {
	c.mu.Lock()
	c.primary = replica
	c.replicas = slices.DeleteFunc(slices.Clone(c.replicas), func(r *Node) bool { return r == replica })
	c.retired = append(c.retired, old)
	replicas = slices.Clone(c.replicas)
	c.mu.Unlock()
	old.mu.Lock()
	old.retired = true
	old.mu.Unlock()
	return replicas
}

// promote runs pg_promote on n and waits for it.
func (n *Node) promote(ctx context.Context) error {
	conn, err := n.connect(ctx, "")
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(context.Background()) }()
	var ok bool
	err = conn.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&ok)
	if err == nil && !ok {
		err = errors.New("pg_promote returned false (not promoted within 60 s)")
	}
	if err != nil {
		return fmt.Errorf("pgtest: promote %s: %w; log:\n%s", n.name, err, testsvc.LogTail(n.logPath, 0))
	}
	return nil
}
