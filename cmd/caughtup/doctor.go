package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/replicapool"
)

const doctorSynopsis = `doctor --primary URL --replica [NAME=]URL [--replica ...] [--database main]
       [--redis URL] [--redis-mode single|cluster|sentinel] [--redis-ca FILE]
       [--feed default] [--keys-file FILE | $CAUGHTUP_FEED_KEYS] [--key-id ID] [--insecure]
       [--connections 8] [--timeout 10s]

Checks a deployment before caughtup runs on it. It takes the flags and the
environment of caughtup feed: replace "feed" by "doctor" in a feed's command
line (--name, --interval and --heartbeat are accepted and not used). It
prints one row per check and node:

  ✓ passed   ✗ failed, with the fix under it   ? not checked, because of a ✗
  ! warning  i information, with a recommendation

and exits 0 when no row is ✗ or ?, 1 otherwise, 2 for bad flags. It
changes nothing in PostgreSQL; in Redis it publishes one observation (see
redis ACL).

The position feed is checked only when it is configured: keys are given
(--keys-file or $CAUGHTUP_FEED_KEYS), or a flag only caughtup feed uses
(--feed, --key-id, --insecure, --name, --interval, --heartbeat). Without
a feed there is one "feed" row saying so and no feed keys or redis ACL
rows; a --redis is then checked for PING only (a Redis for the fleet
budget, say).

Checks:

  reachable   each node (--primary, every --replica) accepts a connection
              as the URL's role; the error if not.
  replication on the primary: --primary reaches a server not in
              recovery, whose system identifier (pg_control_system()) and
              timeline (the first 8 hex digits of
              pg_walfile_name(pg_current_wal_lsn())) the replicas must
              share. On each replica: it is a standby of that primary,
              with the same system identifier, in recovery, on the
              primary's timeline (pg_stat_wal_receiver.received_tli), its
              WAL receiver streaming. A standby of another cluster, a
              promoted one, or one whose receiver stopped fails.
  topology    --connections fresh connections to each replica URL (not a
              pool), each holding a transaction open until all have read:
              which servers they reach (system identifier,
              inet_server_addr()/inet_server_port(),
              pg_postmaster_start_time()) and whether a pooler answers for
              them (pg_backend_pid() is not the connection's own). One
              server passes; several behind a balancer, and a pooler (i),
              are supported and say what they cost per job, in the words
              the router logs. It is a sample: the router checks every
              connection it hands out whatever the sample showed.
  grants      the role of each URL may run every function caughtup's
              queries call (has_function_privilege) and has the privileges
              of pg_read_all_stats (as a member of it or of pg_monitor),
              without which pg_stat_wal_receiver hides received_tli and
              caughtup must treat every replica as unknown. The fix is
              the GRANT statements to run on the primary.
  history     (warning) the primary's role may read the timeline history
              file (EXECUTE on pg_read_file(text)); without it, after a
              failover tokens from older timelines read the primary and a
              standby left on an older timeline is not recognized as
              diverged.
  clock       this host's clock against the primary's (clock_timestamp()
              over the fastest of 5 round trips): ✗ when more than 1s
              apart, since token ages and the feed's MaxDelay compare wall
              clocks of different machines.
  redis       Redis answers PING. Without --redis and $CAUGHTUP_REDIS_URL
              this is one "not configured" row and the Redis checks are
              not run.
  feed        (information) without a configured feed: that the feed
              checks are not run, and how to run them.
  feed keys   (with a feed) keys to sign with (--keys-file,
              $CAUGHTUP_FEED_KEYS), or --insecure: caughtup feed refuses to
              start without either.
  redis ACL   (with a feed) the URL's Redis user may do what a feed
              publisher does (feed.PublisherACL): doctor publishes,
              through the feed's own sender and signed with the feed's
              key, one error observation of the database
              "caughtup-doctor", which routers ignore (they count it as an
              unknown node and log that at info level). The fix is the ACL
              SETUSER line.
  settings    (information) hot_standby_feedback and
              max_standby_streaming_delay on each replica,
              synchronous_commit on the primary, and what they mean for
              caughtup.`

// doctorDatabase names the database of the observation doctor publishes
// to check the Redis ACL: no router has it, so every router ignores it.
const doctorDatabase = "caughtup-doctor"

// maxClockSkew is the skew beyond which the clock row fails.
const maxClockSkew = time.Second

// mark is a row's verdict.
type mark uint8

const (
	markPass mark = iota
	markFail
	markUnknown // not checked, because of another row's ✗
	markWarn
	markInfo
)

func (m mark) String() string { return [...]string{"✓", "✗", "?", "!", "i"}[m] }

// failing: ✗ and ? decide the exit status, ! and i never do. A ? always
// follows from a ✗ elsewhere; counting it too means that no path of the
// checks can end in status 0 with something unchecked.
func (m mark) failing() bool { return m == markFail || m == markUnknown }

// row is one line of the report.
type row struct {
	mark  mark
	check string
	node  string
	found string
	fix   []string
}

// doctorNode is one PostgreSQL URL and what its first connection read.
type doctorNode struct {
	name    string
	primary bool
	cfg     *pgx.ConnConfig
	conn    *pgx.Conn
	err     error // connecting
	id      pgwal.Identity
	idErr   error
	rights  pgwal.RoleRights
	rErr    error
}

type doctor struct {
	d        deployment
	feed     bool // a position feed is configured (see doctorSynopsis)
	ring     feed.Keyring
	rdb      redis.UniversalClient // nil: not configured
	redisURL string
	timeout  time.Duration
	samples  int
	primary  *doctorNode
	replicas []*doctorNode
	rows     []row

	primaryOK bool   // the primary row passed
	timeline  uint32 // the primary's
}

func runDoctor(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet(doctorSynopsis, stdout, doctorIgnores...)
	var d deployment
	d.register(fs)
	samples := fs.Int("connections", 8, "fresh connections per replica URL for the one-server check")
	timeout := fs.Duration("timeout", 10*time.Second, "bound on each connection and on each check's queries")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("unexpected argument %q", fs.Arg(0))}
	}
	if err := d.validate(); err != nil {
		return err
	}
	if *timeout <= 0 {
		return usageError{"--timeout must be positive"}
	}
	if *samples < 2 {
		return usageError{"--connections must be at least 2"}
	}
	doc := &doctor{d: d, timeout: *timeout, samples: *samples}
	cfg, err := nodeConfig(d.primary)
	if err != nil {
		return err
	}
	doc.primary = &doctorNode{name: "primary", primary: true, cfg: cfg}
	replicas, err := parseReplicas(d.replicas)
	if err != nil {
		return err
	}
	for _, r := range replicas {
		cfg, err := nodeConfig(r.dsn)
		if err != nil {
			return err
		}
		doc.replicas = append(doc.replicas, &doctorNode{name: r.name, cfg: cfg})
	}
	if doc.ring, err = d.keyring(); err != nil {
		return err
	}
	doc.feed = len(doc.ring.Keys) > 0
	fs.Visit(func(f *flag.Flag) { doc.feed = doc.feed || slices.Contains(feedOnlyFlags, f.Name) })
	if rawURL, given := d.redisTarget(); given {
		if doc.rdb, err = d.redisClient(rawURL); err != nil {
			return err
		}
		defer doc.rdb.Close()
		doc.redisURL = redactURL(rawURL)
	}

	doc.run(ctx)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	doc.print(stdout)
	failing := 0
	for _, r := range doc.rows {
		if r.mark.failing() {
			failing++
		}
	}
	if failing > 0 {
		return fmt.Errorf("%d of %d rows are ✗ or ?; the fixes are under the ✗ rows", failing, len(doc.rows))
	}
	return nil
}

// nodeConfig parses one node's URL for fresh connections of their own.
func nodeConfig(dsn string) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, usageError{"bad connection string: " + err.Error()}
	}
	if _, set := cfg.RuntimeParams["application_name"]; !set {
		cfg.RuntimeParams["application_name"] = "caughtup doctor"
	}
	return cfg, nil
}

// redactURL hides the passwords of a URL that is printed: the user's,
// and the query's (?password= and ?sentinel_password= of go-redis's
// Sentinel and Cluster URLs).
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "the --redis URL"
	}
	q := u.Query()
	for k := range q {
		if strings.Contains(strings.ToLower(k), "password") {
			q.Set(k, "xxxxx")
		}
	}
	u.RawQuery = q.Encode()
	return u.Redacted()
}

func (doc *doctor) add(r row) { doc.rows = append(doc.rows, r) }

func (doc *doctor) nodes() []*doctorNode { return append([]*doctorNode{doc.primary}, doc.replicas...) }

// bounded returns a context for one check.
func (doc *doctor) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, doc.timeout)
}

func (doc *doctor) run(ctx context.Context) {
	for _, n := range doc.nodes() {
		doc.connect(ctx, n)
	}
	defer func() {
		for _, n := range doc.nodes() {
			if n.conn != nil {
				_ = n.conn.Close(context.Background())
			}
		}
	}()
	doc.checkPrimary(ctx)
	for _, r := range doc.replicas {
		doc.checkStandby(ctx, r)
	}
	for _, r := range doc.replicas {
		doc.checkTopology(ctx, r)
	}
	for _, n := range doc.nodes() {
		doc.checkGrants(n)
	}
	doc.checkHistory()
	doc.checkClock(ctx)
	doc.checkRedis(ctx)
	for _, n := range doc.nodes() {
		doc.checkSettings(ctx, n)
	}
}

// connect opens n's connection for the checks and reads what the server
// says about itself and what its role may do.
func (doc *doctor) connect(ctx context.Context, n *doctorNode) {
	ctx, cancel := doc.bounded(ctx)
	defer cancel()
	n.conn, n.err = pgx.ConnectConfig(ctx, n.cfg)
	if n.err != nil {
		fix := []string{"check the URL, the network and the server's pg_hba.conf: the error is the server's or the network's"}
		if p, ok := pgwal.MissingPrivilege(n.err); ok { // CONNECT on the database, refused before any query
			fix = []string{"run on the primary (standbys replay it):", p.GrantSQL(n.cfg.User)}
		}
		doc.add(row{mark: markFail, check: "reachable", node: n.name, found: oneLine(n.err.Error()), fix: fix})
		return
	}
	n.id, n.idErr = pgwal.ReadIdentity(ctx, n.conn)
	n.rights, n.rErr = pgwal.ReadRights(ctx, n.conn)
	found := "as role " + quoteRole(n.conn.Config().User)
	if n.idErr == nil {
		found = fmt.Sprintf("PostgreSQL %s at %s, %s", versionText(n.id.ServerVersion), serverAddr(n.id), found)
	}
	doc.add(row{mark: markPass, check: "reachable", node: n.name, found: found})
}

func versionText(num int) string { return fmt.Sprintf("%d.%d", num/10000, num%100) }

func serverAddr(id pgwal.Identity) string {
	if id.Addr == "" {
		return "a unix socket"
	}
	return joinHost(id.Addr, id.Port)
}

func quoteRole(r string) string { return strconv.Quote(r) }

// unreachable adds the ? row of a check that needs a node that did not
// answer.
func (doc *doctor) unreachable(check string, n *doctorNode, because *doctorNode) bool {
	switch {
	case n.err != nil:
		doc.add(row{mark: markUnknown, check: check, node: n.name, found: "not checked: the node is unreachable"})
	case because != nil && because.err != nil:
		doc.add(row{mark: markUnknown, check: check, node: n.name, found: "not checked: the " + because.name + " is unreachable"})
	default:
		return false
	}
	return true
}

// checkPrimary reads the primary's timeline, which the standby rows
// compare with (primaryOK: they can).
func (doc *doctor) checkPrimary(ctx context.Context) {
	n := doc.primary
	if doc.unreachable("replication", n, nil) {
		return
	}
	ctx, cancel := doc.bounded(ctx)
	p, err := pgwal.ReadPrimary(ctx, n.conn, 0)
	cancel()
	switch {
	case errors.Is(err, pgwal.ErrInRecovery):
		doc.add(row{mark: markFail, check: "replication", node: n.name, found: "in recovery: --primary reaches a standby",
			fix: []string{"give --primary the primary's URL (after a failover, the promoted server's)"}})
	case err != nil:
		doc.add(row{mark: markFail, check: "replication", node: n.name, found: "cannot read its WAL position: " + oneLine(err.Error()),
			fix: []string{"see the grants row of the primary"}})
	default:
		doc.primaryOK, doc.timeline = true, p.Timeline
		found := fmt.Sprintf("not in recovery, timeline %d", p.Timeline)
		if n.idErr == nil && n.id.SystemIDKnown {
			found += fmt.Sprintf(", system %d", n.id.SystemID)
		}
		doc.add(row{mark: markPass, check: "replication", node: n.name, found: found})
	}
}

// standbyFix is what to do about a standby that does not stream from the
// primary.
var standbyFix = []string{
	"on the standby, set primary_conninfo (and primary_slot_name) to reach the primary, then SELECT pg_reload_conf();",
	"its server log says why the WAL receiver stopped or cannot connect",
}

func (doc *doctor) checkStandby(ctx context.Context, n *doctorNode) {
	const check = "replication"
	if doc.unreachable(check, n, doc.primary) {
		return
	}
	if !doc.primaryOK {
		doc.add(row{mark: markUnknown, check: check, node: n.name, found: "not checked: the primary's replication row failed"})
		return
	}
	rctx, cancel := doc.bounded(ctx)
	r, err := pgwal.ReadReplica(rctx, n.conn, 0)
	cancel()
	if err == nil {
		err = n.idErr
	}
	if err != nil {
		doc.add(row{mark: markFail, check: check, node: n.name, found: "cannot read its replay state: " + oneLine(err.Error()),
			fix: []string{"see the grants row of " + n.name}})
		return
	}
	p, id := doc.primary.id, n.id
	var hidden []string
	if !id.SystemIDKnown || !p.SystemIDKnown {
		hidden = append(hidden, "system identifier")
	}
	switch {
	case !r.InRecovery:
		doc.add(row{mark: markFail, check: check, node: n.name, found: "not in recovery: a primary (a promoted standby?), not a standby",
			fix: []string{"give this --replica a standby of the primary"}})
		return
	case id.SystemIDKnown && p.SystemIDKnown && id.SystemID != p.SystemID:
		doc.add(row{mark: markFail, check: check, node: n.name,
			found: fmt.Sprintf("system identifier %d, the primary's is %d: a standby of another cluster", id.SystemID, p.SystemID),
			fix:   []string{"give this --replica a standby of the primary, or --primary the primary of this standby"}})
		return
	case !id.Receiver.Running:
		doc.add(row{mark: markFail, check: check, node: n.name,
			found: "in recovery, but no WAL receiver runs: it is not streaming, and replays only WAL it already has (or restore_command fetches)",
			fix:   standbyFix})
		return
	case id.Receiver.Status != "" && id.Receiver.Status != "streaming":
		doc.add(row{mark: markFail, check: check, node: n.name, found: "WAL receiver is " + strconv.Quote(id.Receiver.Status) + ", not streaming", fix: standbyFix})
		return
	case r.Timeline != 0 && r.Timeline != doc.timeline:
		doc.add(row{mark: markFail, check: check, node: n.name,
			found: fmt.Sprintf("receives timeline %d, the primary is on %d", r.Timeline, doc.timeline),
			fix: []string{"re-point the standby at the primary with recovery_target_timeline = 'latest';",
				"if it replayed past the switchpoint of the primary's timeline it has diverged: rebuild it from a base backup"}})
		return
	}
	if r.Timeline == 0 {
		hidden = append(hidden, "timeline")
	}
	if id.Receiver.Status == "" {
		hidden = append(hidden, "receiver status")
	}
	if len(hidden) > 0 {
		doc.add(row{mark: markUnknown, check: check, node: n.name,
			found: "in recovery, its WAL receiver running; " + strings.Join(hidden, ", ") + " hidden from the role: see the grants rows"})
		return
	}
	found := fmt.Sprintf("system %d, in recovery, timeline %d, streaming", id.SystemID, r.Timeline)
	if id.Receiver.SenderHost != "" {
		found += " from " + joinHost(id.Receiver.SenderHost, id.Receiver.SenderPort)
	}
	doc.add(row{mark: markPass, check: check, node: n.name, found: found})
}

func joinHost(host string, port int) string {
	if strings.Contains(host, ":") {
		return fmt.Sprintf("[%s]:%d", host, port)
	}
	return host + ":" + strconv.Itoa(port)
}

// sample is what one fresh connection reached.
type sample struct {
	id pgwal.Identity
	// pooled: the server process that answered is not the one the
	// connection's key data named (a pooler answers for the server).
	pooled bool
	err    error
}

// maxHold bounds how long a sampling connection keeps its transaction
// open waiting for the others: long enough for a pooler to have handed
// each of them its own server connection, short enough that a pool
// smaller than --connections (whose later clients wait for the earlier
// ones) only delays the check.
const maxHold = time.Second

// samples opens doc.samples fresh connections to n at once. Each reads
// in a transaction that it holds until all have read (or maxHold), so
// that through PgBouncer in transaction pooling each has its own server
// connection rather than the one the previous client released.
func (doc *doctor) sampleServers(ctx context.Context, n *doctorNode) []sample {
	ctx, cancel := doc.bounded(ctx)
	defer cancel()
	out := make([]sample, doc.samples)
	var read, done sync.WaitGroup
	read.Add(len(out))
	done.Add(len(out))
	release := make(chan struct{})
	for i := range out {
		go func() {
			defer done.Done()
			conn, err := pgx.ConnectConfig(ctx, n.cfg.Copy())
			var tx pgx.Tx
			if err == nil {
				tx, err = conn.Begin(ctx)
			}
			if err == nil {
				out[i].id, err = pgwal.ReadIdentity(ctx, tx)
			}
			if err == nil {
				var pid uint32
				err = tx.QueryRow(ctx, "SELECT pg_backend_pid()", pgx.QueryExecModeSimpleProtocol).Scan(&pid)
				out[i].pooled = pgwal.ThroughPooler(conn.PgConn(), pid)
			}
			out[i].err = err
			read.Done()
			if conn == nil {
				return
			}
			select {
			case <-release:
			case <-ctx.Done():
			}
			end, stop := context.WithTimeout(context.Background(), time.Second)
			defer stop()
			_ = conn.Close(end) // ends the transaction too
		}()
	}
	allRead := make(chan struct{})
	go func() { read.Wait(); close(allRead) }()
	hold := time.NewTimer(maxHold)
	select {
	case <-allRead:
	case <-hold.C:
	}
	hold.Stop()
	close(release)
	done.Wait()
	return out
}

// checkTopology samples fresh connections to a replica URL and says what
// routing through it costs, with the router's own rule
// (replicapool.TopologyOf) and words (Topology.Cost): one server, several
// behind a balancer, or a pooler in between are all supported.
func (doc *doctor) checkTopology(ctx context.Context, n *doctorNode) {
	const check = "topology"
	if doc.unreachable(check, n, nil) {
		return
	}
	type server struct {
		id    pgwal.Identity
		count int
	}
	var servers []*server
	var failed []error
	pooled := false
	for _, s := range doc.sampleServers(ctx, n) {
		if s.err != nil {
			failed = append(failed, s.err)
			continue
		}
		pooled = pooled || s.pooled
		found := false
		for _, sv := range servers {
			if sv.id.Same(s.id) {
				sv.count++
				found = true
				break
			}
		}
		if !found {
			servers = append(servers, &server{id: s.id, count: 1})
		}
	}
	names := make([]string, len(servers))
	for i, sv := range servers {
		names[i] = fmt.Sprintf("%s ×%d", sv.id.Server(), sv.count)
	}
	topo := replicapool.TopologyOf(len(servers), pooled)
	reached := fmt.Sprintf("%d fresh connections, %d server", doc.samples, len(servers))
	if len(servers) != 1 {
		reached += "s"
	}
	reached += ": " + strings.Join(names, "; ")
	if pooled {
		reached += ", through a pooler"
	}
	switch {
	case len(failed) > 0:
		doc.add(row{mark: markFail, check: check, node: n.name,
			found: fmt.Sprintf("%d of %d fresh connections failed: %s", len(failed), doc.samples, oneLine(failed[0].Error())),
			fix:   []string{"every connection must reach a standby: a balancer with a dead server behind it, or max_connections reached?"}})
	case topo == replicapool.TopologySingle:
		doc.add(row{mark: markPass, check: check, node: n.name, found: reached + "; " + topo.Cost()})
	default:
		// Supported, at a cost per job the operator should know of; a
		// sample of one server cannot rule a balancer out (the router
		// checks every connection anyway).
		doc.add(row{mark: markInfo, check: check, node: n.name, found: reached + "; " + topo.Cost()})
	}
}

func (doc *doctor) checkGrants(n *doctorNode) {
	const check = "grants"
	if doc.unreachable(check, n, nil) {
		return
	}
	if n.rErr != nil {
		doc.add(row{mark: markFail, check: check, node: n.name, found: "cannot read the role's privileges: " + oneLine(n.rErr.Error()),
			fix: []string{"connect as a role that may call has_function_privilege and pg_has_role (every role may, unless revoked)"}})
		return
	}
	role := n.rights.Role
	missing := n.rights.MissingAt(pgwal.Required)
	if len(missing) == 0 {
		found := "role " + quoteRole(role) + ": superuser"
		if !n.rights.Superuser {
			found = "role " + quoteRole(role) + " may call every function caughtup's queries do, and has pg_read_all_stats' privileges"
		}
		doc.add(row{mark: markPass, check: check, node: n.name, found: found})
		return
	}
	noInherit := map[string]bool{}
	for _, r := range n.rights.NoInherit {
		noInherit[r] = true
	}
	var what, lost []string
	fix := []string{"run on the primary (standbys replay it):"}
	seen := map[string]bool{}
	for _, p := range missing {
		name := p.Name()
		if p.Role == "pg_read_all_stats" {
			name += " (directly or through pg_monitor)"
		}
		what = append(what, name)
		if !seen[p.Lost] {
			seen[p.Lost] = true
			lost = append(lost, p.Lost)
		}
		switch {
		case noInherit[p.Role] && n.id.ServerVersion >= 160000:
			fix = append(fix, "GRANT "+p.Role+" TO "+pgx.Identifier{role}.Sanitize()+" WITH INHERIT TRUE;")
		case noInherit[p.Role]:
			fix = append(fix, "ALTER ROLE "+pgx.Identifier{role}.Sanitize()+" INHERIT;")
		default:
			fix = append(fix, p.GrantSQL(role))
		}
	}
	doc.add(row{mark: markFail, check: check, node: n.name,
		found: "role " + quoteRole(role) + " lacks " + strings.Join(what, ", ") + ": " + strings.Join(lost, "; "), fix: fix})
}

// checkHistory: the history file is read from the primary, by the role
// of --primary.
func (doc *doctor) checkHistory() {
	n := doc.primary
	if doc.unreachable("history", n, nil) {
		return
	}
	if n.rErr != nil {
		doc.add(row{mark: markUnknown, check: "history", node: n.name, found: "not checked: see the grants row"})
		return
	}
	missing := n.rights.MissingAt(pgwal.Degraded)
	if len(missing) == 0 {
		doc.add(row{mark: markPass, check: "history", node: n.name, found: "role " + quoteRole(n.rights.Role) + " may read the timeline history files"})
		return
	}
	var what, lost, fix []string
	for _, p := range missing {
		what = append(what, p.Name())
		lost = append(lost, p.Lost)
		fix = append(fix, p.GrantSQL(n.rights.Role))
	}
	doc.add(row{mark: markWarn, check: "history", node: n.name,
		found: "role " + quoteRole(n.rights.Role) + " lacks " + strings.Join(what, ", ") + ", so caughtup loses " + strings.Join(lost, "; "),
		fix:   append([]string{"to keep it, run on the primary:"}, fix...)})
}

// clockSamples is how many round trips the clock check makes; the
// fastest bounds the skew most tightly.
const clockSamples = 5

func (doc *doctor) checkClock(ctx context.Context) {
	n := doc.primary
	if doc.unreachable("clock", n, nil) {
		return
	}
	ctx, cancel := doc.bounded(ctx)
	defer cancel()
	var best time.Duration = -1
	var skew time.Duration
	for range clockSamples {
		sent := time.Now()
		server, err := pgwal.ReadClock(ctx, n.conn)
		rtt := time.Since(sent)
		if err != nil {
			doc.add(row{mark: markFail, check: "clock", node: n.name, found: "cannot read the primary's clock: " + oneLine(err.Error())})
			return
		}
		if best < 0 || rtt < best {
			// The server read its clock somewhere within the round trip:
			// its middle is the best guess, half the round trip the error.
			best, skew = rtt, server.Sub(sent.Add(rtt/2))
		}
	}
	doc.add(clockRow(n.name, skew, best))
}

// clockRow judges a measured skew (the primary's clock minus this host's)
// within ± rtt/2: it fails only when the skew is certainly above
// maxClockSkew.
func clockRow(node string, skew, rtt time.Duration) row {
	found := fmt.Sprintf("the primary's clock minus this host's: %+v (±%v)", skew.Round(10*time.Microsecond), (rtt / 2).Round(10*time.Microsecond))
	abs := skew
	if abs < 0 {
		abs = -abs
	}
	if abs-rtt/2 > maxClockSkew {
		return row{mark: markFail, check: "clock", node: node, found: found + fmt.Sprintf(", over %v", maxClockSkew),
			fix: []string{"synchronize the clocks of this host, the primary, the producers and the routers (chrony or systemd-timesyncd against the same NTP servers):",
				"token ages (deferral deadlines) and the feed's MaxDelay compare wall clocks of different machines"}}
	}
	return row{mark: markPass, check: "clock", node: node, found: found}
}

// noFeed is the row of a deployment without a configured feed.
var noFeed = row{mark: markInfo, check: "feed", found: "not configured: no keys ($CAUGHTUP_FEED_KEYS, --keys-file) and no flag of caughtup feed's own, so no feed checks; " +
	"to check a position feed, give doctor the flags of its caughtup feed command"}

// checkRedis adds the redis row and, with a feed, the feed keys and redis
// ACL rows; without one, the feed row.
func (doc *doctor) checkRedis(ctx context.Context) {
	if doc.rdb == nil {
		doc.add(row{mark: markInfo, check: "redis", found: "not configured: no --redis and no $CAUGHTUP_REDIS_URL, so no Redis checks (caughtup feed would use redis://127.0.0.1:6379/0)"})
		if !doc.feed {
			doc.add(noFeed)
		}
		return
	}
	user := redisUser(doc.rdb)

	pctx, cancel := doc.bounded(ctx)
	err := doc.rdb.Ping(pctx).Err()
	cancel()
	var pingErr error
	reached := true
	switch {
	case err == nil:
		doc.add(row{mark: markPass, check: "redis", found: doc.redisURL + " answered PING, as user " + strconv.Quote(user)})
	case isNoPerm(err):
		pingErr = err
		found := doc.redisURL + " answered, as user " + strconv.Quote(user) + " (who may not PING"
		if doc.feed {
			found += ": see redis ACL"
		}
		doc.add(row{mark: markPass, check: "redis", found: found + ")"})
	default:
		reached = false
		doc.add(row{mark: markFail, check: "redis", found: doc.redisURL + ": " + oneLine(err.Error()),
			fix: []string{"check --redis (its user and password; $CAUGHTUP_REDIS_URL keeps them off the command line), --redis-mode, --redis-ca and the network"}})
	}
	if !doc.feed {
		doc.add(noFeed)
		return
	}
	keysOK := doc.checkKeys()
	if !reached {
		doc.add(row{mark: markUnknown, check: "redis ACL", found: "not checked: Redis is unreachable"})
		return
	}
	if !keysOK {
		doc.add(row{mark: markUnknown, check: "redis ACL",
			found: "not checked without the feed's keys: routers would log an unsigned or foreign-key observation as a forgery"})
		return
	}
	aclFix := []string{"as an admin of this Redis:",
		"ACL SETUSER " + user + " on >PASSWORD " + feed.PublisherACL(doc.d.feedName),
		"(on Redis 7.2+ add +client|setinfo to keep go-redis's CLIENT SETINFO out of ACL LOG)"}
	pubErr := doc.publishProbe(ctx)
	if err := errors.Join(pingErr, pubErr); err != nil {
		m := row{mark: markFail, check: "redis ACL", found: "user " + strconv.Quote(user) + " cannot publish feed " + strconv.Quote(doc.d.feedName) + ": " + oneLine(err.Error())}
		if isNoPerm(err) {
			m.fix = aclFix
		}
		doc.add(m)
		return
	}
	doc.add(row{mark: markPass, check: "redis ACL",
		found: "user " + strconv.Quote(user) + " published an observation of database " + strconv.Quote(doctorDatabase) + " on " + feed.ChannelName(doc.d.feedName) + " as caughtup feed does (SET, PUBLISH, SADD, PEXPIRE)"})
}

// checkKeys adds the feed keys row and says whether the ACL can be
// checked with them.
func (doc *doctor) checkKeys() bool {
	ring := doc.ring
	switch {
	case len(ring.Keys) == 0 && !doc.d.insecure:
		doc.add(row{mark: markFail, check: "feed keys", found: "no keys and no --insecure: caughtup feed refuses to start",
			fix: []string{"give --keys-file or $CAUGHTUP_FEED_KEYS (make a key with caughtup feed --generate-key ID), the same keys as the routers'"}})
		return false
	case len(ring.Keys) == 0:
		doc.add(row{mark: markWarn, check: "feed keys", found: "--insecure: unsigned observations, which routers take only when Insecure too; anyone who may publish on the channel can move them",
			fix: []string{"give the publishers and routers keys (caughtup feed --generate-key ID)"}})
		return true
	}
	ids := make([]string, len(ring.Keys))
	current := ""
	for i, k := range ring.Keys {
		ids[i] = k.ID
		if k.ID == ring.Current || (ring.Current == "" && i == 0) {
			current = k.ID
		}
	}
	if current == "" {
		doc.add(row{mark: markFail, check: "feed keys", found: fmt.Sprintf("--key-id %q is not among the keys (%s)", ring.Current, strings.Join(ids, ", ")),
			fix: []string{"give --key-id one of the keys' IDs, or add its key"}})
		return false
	}
	doc.add(row{mark: markPass, check: "feed keys", found: fmt.Sprintf("%d key(s) (%s), signing with %q", len(ids), strings.Join(ids, ", "), current)})
	return true
}

// publishProbe publishes one observation the way caughtup feed does,
// through feed.Sender: the commands, keys and channel it uses are then
// exactly the feed's, whatever they become. The observation is an error
// observation of doctorDatabase, which routers do not have.
func (doc *doctor) publishProbe(ctx context.Context) error {
	s, err := feed.NewSender(feed.SenderConfig{Client: doc.rdb, Feed: doc.d.feedName, Name: "caughtup-doctor", Keys: doc.ring,
		Insecure: doc.d.insecure, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	defer s.Close()
	if err := s.Publish(feed.Observation{Database: doctorDatabase, Role: feed.RolePrimary,
		Err: "caughtup doctor: checking the Redis ACL of this feed; not a database"}); err != nil {
		return err
	}
	ctx, cancel := doc.bounded(ctx)
	defer cancel()
	return s.Flush(ctx)
}

func isNoPerm(err error) bool { return err != nil && strings.Contains(err.Error(), "NOPERM") }

// redisUser is the user the client authenticates as.
func redisUser(c redis.UniversalClient) string {
	var u string
	switch c := c.(type) {
	case *redis.Client:
		u = c.Options().Username
	case *redis.ClusterClient:
		u = c.Options().Username
	}
	if u == "" {
		return "default"
	}
	return u
}

func (doc *doctor) checkSettings(ctx context.Context, n *doctorNode) {
	if n.conn == nil {
		return // its reachable row is ✗; settings are information only
	}
	names := []string{"hot_standby_feedback", "max_standby_streaming_delay"}
	if n.primary {
		names = []string{"synchronous_commit"}
	}
	ctx, cancel := doc.bounded(ctx)
	defer cancel()
	s, err := pgwal.ReadSettings(ctx, n.conn, names...)
	if err != nil {
		doc.add(row{mark: markWarn, check: "settings", node: n.name, found: "cannot read " + strings.Join(names, ", ") + ": " + oneLine(err.Error())})
		return
	}
	for _, name := range names {
		m, text := settingAdvice(name, s[name])
		doc.add(row{mark: m, check: "settings", node: n.name, found: name + " = " + s[name] + ": " + text})
	}
}

// settingAdvice says what a setting's value means for caughtup.
func settingAdvice(name, value string) (mark, string) {
	switch name {
	case "hot_standby_feedback":
		if value == "on" {
			return markInfo, "this standby's queries hold back VACUUM on the primary (bloat while they run), and cleanup on the primary neither cancels them nor stalls replay here"
		}
		return markInfo, "VACUUM on the primary can conflict with this standby's queries: replay then waits for them up to max_standby_streaming_delay " +
			"(jobs needing newer data wait, defer or use the primary) and cancels them; turn it on if long replica queries matter more than bloat"
	case "max_standby_streaming_delay":
		if value == "-1" {
			return markWarn, "replay waits forever for a conflicting query, so this standby can fall behind without bound; set a bound (30s is the default)"
		}
		return markInfo, "a conflicting query can stall replay here for up to " + value + ", and tokens newer than that wait, defer or go to the primary meanwhile; " +
			"lower it to bound that, raise it to cancel fewer long queries"
	case "synchronous_commit":
		switch value {
		case "off":
			return markWarn, "a primary crash can lose commits already acknowledged, and their LSNs are then reused: no token can tell (design fact 10), " +
				"so consumers must tolerate \"row not found\"; set it to on unless that is acceptable"
		case "remote_apply":
			return markInfo, "commits return once the synchronous standbys applied them; caughtup still checks every replica's position"
		}
		return markInfo, "acknowledged commits are flushed to WAL first, so a crash of the primary does not lose them"
	}
	return markInfo, ""
}

// print renders the rows: mark, check, node and what was found in
// columns, each fix on its own lines under the finding.
func (doc *doctor) print(w io.Writer) {
	feedText := "no feed"
	if doc.feed {
		feedText = "feed " + strconv.Quote(doc.d.feedName)
	}
	fmt.Fprintf(w, "caughtup doctor: database %q, primary and %d replica(s), %s\n\n", doc.d.database, len(doc.replicas), feedText)
	cw, nw := len("CHECK"), len("NODE")
	for _, r := range doc.rows {
		cw, nw = max(cw, textWidth(r.check)), max(nw, textWidth(r.node))
	}
	pad := func(s string, n int) string { return s + strings.Repeat(" ", n-textWidth(s)) }
	indent := strings.Repeat(" ", 3+cw+2+nw+2)
	fmt.Fprintf(w, "   %s  %s  FOUND\n", pad("CHECK", cw), pad("NODE", nw))
	for _, r := range doc.rows {
		fmt.Fprintf(w, "%s  %s  %s  %s\n", r.mark, pad(r.check, cw), pad(r.node, nw), r.found)
		for i, f := range r.fix {
			lead := "     "
			if i == 0 {
				lead = "fix: "
			}
			fmt.Fprintf(w, "%s%s%s\n", indent, lead, f)
		}
	}
}

func textWidth(s string) int { return len([]rune(s)) }
