package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replicapool"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// reportRow is one row of a doctor report as printed.
type reportRow struct {
	mark, check, node, found string
	fix                      []string
}

func (r reportRow) key() string { return r.check + " " + r.node }

// parseReport reads the rows back by the header's columns.
func parseReport(t *testing.T, out string) []reportRow {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	h := -1
	for i, l := range lines {
		if strings.HasPrefix(l, "   CHECK ") {
			h = i
			break
		}
	}
	require.GreaterOrEqual(t, h, 0, "no header in %q", out)
	header := []rune(lines[h])
	col := func(name string) int { return strings.Index(string(header), name) } // ASCII header: bytes are runes
	cNode, cFound := col("NODE"), col("FOUND")
	var rows []reportRow
	for _, l := range lines[h+1:] {
		r := []rune(l)
		require.Greater(t, len(r), cFound, "short line %q", l)
		if r[0] == ' ' {
			require.NotEmpty(t, rows, "a fix line before any row")
			f := strings.TrimSpace(string(r[cFound:]))
			f = strings.TrimPrefix(f, "fix: ")
			rows[len(rows)-1].fix = append(rows[len(rows)-1].fix, f)
			continue
		}
		rows = append(rows, reportRow{mark: string(r[0]), check: strings.TrimSpace(string(r[3:cNode])),
			node: strings.TrimSpace(string(r[cNode:cFound])), found: string(r[cFound:])})
	}
	return rows
}

// byMark groups the rows' keys by mark.
func byMark(rows []reportRow) map[string][]string {
	out := map[string][]string{}
	for _, r := range rows {
		out[r.mark] = append(out[r.mark], r.key())
	}
	return out
}

func findRow(t *testing.T, rows []reportRow, key string) reportRow {
	t.Helper()
	for _, r := range rows {
		if r.key() == key {
			return r
		}
	}
	t.Fatalf("no row %q in %v", key, rows)
	return reportRow{}
}

// doctorEnv is what the doctor tests run against: a cluster, the shared
// Redis and a feed with a key of its own.
type doctorEnv struct {
	redis    *pgtest.Redis
	feedName string
	keysFile string
	keys     []feed.Key
}

func newDoctorEnv(t *testing.T) doctorEnv {
	t.Helper()
	rs := pgtest.SharedRedis(t)
	k, err := feed.GenerateKey("k1")
	require.NoError(t, err)
	keysFile := filepath.Join(t.TempDir(), "keys")
	require.NoError(t, os.WriteFile(keysFile, []byte(k.Export()+"\n"), 0o600))
	return doctorEnv{redis: rs, feedName: fmt.Sprintf("doctor-%d", time.Now().UnixNano()), keysFile: keysFile, keys: []feed.Key{k}}
}

// args are doctor's flags for primary and the NAME=URL replicas, with
// the env's Redis (as redisUser, "" for the default user) and feed.
func (e doctorEnv) args(primary, redisUserInfo string, replicas ...string) []string {
	if redisUserInfo != "" {
		redisUserInfo += "@"
	}
	a := []string{"doctor", "--primary", primary, "--redis", "redis://" + redisUserInfo + e.redis.Addr() + "/0",
		"--feed", e.feedName, "--keys-file", e.keysFile}
	for _, r := range replicas {
		a = append(a, "--replica", r)
	}
	return a
}

// dsnAs is n's DSN for role.
func dsnAs(role string, n *pgtest.Node) string {
	return fmt.Sprintf("postgres://%s@127.0.0.1:%d/postgres?sslmode=disable", role, n.Port())
}

// requireHealthy: exit 0, and every row passes or informs; the rows of
// every check are there, once per node they concern.
func requireHealthy(t *testing.T, code int, out, errOut string, replicas int) []reportRow {
	t.Helper()
	require.Equal(t, 0, code, "%s\n%s", out, errOut)
	rows := parseReport(t, out)
	count := map[string]int{}
	for _, r := range rows {
		require.Contains(t, []string{"✓", "i"}, r.mark, "row %s: %s", r.key(), r.found)
		require.Empty(t, r.fix, r.key())
		count[r.check]++
	}
	n := replicas + 1
	require.Equal(t, map[string]int{"reachable": n, "replication": n, "topology": replicas, "grants": n, "history": 1, "clock": 1,
		"redis": 1, "feed keys": 1, "redis ACL": 1, "settings": 1 + 2*replicas}, count)
	return rows
}

// requireFailing: exit 1, the rows of fail (and only those) are ✗, the
// rows of unknown (and only those) are ?, and no other row is.
func requireFailing(t *testing.T, code int, out string, fail, unknown []string) []reportRow {
	t.Helper()
	require.Equal(t, 1, code, out)
	rows := parseReport(t, out)
	m := byMark(rows)
	require.ElementsMatch(t, fail, m["✗"], out)
	require.ElementsMatch(t, unknown, m["?"], out)
	for _, r := range rows {
		if r.mark == "✗" {
			require.NotEmpty(t, r.fix, "a ✗ row names its fix: %s", r.key())
		}
	}
	return rows
}

// TestDoctorHealthy: the shared cluster and Redis pass every check, and
// the observation doctor publishes to check the ACL is a signed one of
// the database no router has.
func TestDoctorHealthy(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	e := newDoctorEnv(t)
	r := c.Replicas()
	code, out, errOut := runCLI(t, e.args(c.Primary().DSN(""), "", "r1="+r[0].DSN(""), "r2="+r[1].DSN(""))...)
	t.Logf("healthy cluster, exit %d:\n%s", code, out)
	rows := requireHealthy(t, code, out, errOut, 2)
	sys, err := c.Primary().SystemIdentifier(context.Background())
	require.NoError(t, err)
	require.Contains(t, findRow(t, rows, "replication r1").found,
		fmt.Sprintf("system %d, in recovery, timeline 1, streaming from 127.0.0.1:%d", sys, c.Primary().Port()))
	require.Contains(t, findRow(t, rows, "topology r2").found, fmt.Sprintf("8 fresh connections, 1 server: 127.0.0.1:%d", r[1].Port()))
	require.Contains(t, findRow(t, rows, "topology r2").found, replicapool.TopologySingle.Cost())
	require.Contains(t, findRow(t, rows, "grants primary").found, `role "postgres": superuser`)
	require.Contains(t, findRow(t, rows, "settings primary").found, "synchronous_commit = on")

	// The probe is a valid, signed observation, stored like a publisher's.
	rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
	defer rdb.Close()
	var mu sync.Mutex
	var got []feed.Delivery
	sub, err := feed.NewSubscriber(feed.SubscriberConfig{Client: rdb, Feed: e.feedName, Keys: feed.Keyring{Keys: e.keys},
		OnObservation: func(d feed.Delivery) { mu.Lock(); got = append(got, d); mu.Unlock() }})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = sub.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(got) > 0 }, 10*time.Second, 10*time.Millisecond)
	mu.Lock()
	require.Equal(t, doctorDatabase, got[0].Database)
	require.Equal(t, "caughtup-doctor", got[0].Publisher.Name)
	require.True(t, got[0].Stored)
	require.Equal(t, "k1", got[0].KeyID, "signed with the feed's key")
	require.NotEmpty(t, got[0].Err, "an error observation: no position at all")
	mu.Unlock()
}

// TestDoctorBalancedEndpoint: a replica URL that reaches two standbys,
// through HAProxy round robin or PgBouncer over a host list, or one
// standby through PgBouncer, is supported: the topology row names the
// servers and says, in the router's words, what each costs per job; no
// row fails.
func TestDoctorBalancedEndpoint(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	e := newDoctorEnv(t)
	r := c.Replicas()
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(r...)})
	lb := "postgres://postgres@" + h.Addr() + "/postgres?sslmode=disable"
	code, out, errOut := runCLI(t, e.args(c.Primary().DSN(""), "", "lb="+lb)...)
	t.Logf("HAProxy round robin over two standbys as one replica, exit %d:\n%s", code, out)
	rows := requireHealthy(t, code, out, errOut, 1)
	row := findRow(t, rows, "topology lb")
	require.Equal(t, "i", row.mark)
	require.Contains(t, row.found, "8 fresh connections, 2 servers")
	for _, n := range r {
		require.Contains(t, row.found, fmt.Sprintf("127.0.0.1:%d (system ", n.Port()))
	}
	require.Contains(t, row.found, replicapool.TopologyBalanced.Cost())

	both := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(r...)})
	code, out, errOut = runCLI(t, e.args(c.Primary().DSN(""), "", "pgb="+both.DSN("postgres"))...)
	t.Logf("PgBouncer (transaction pooling) over two standbys as one replica, exit %d:\n%s", code, out)
	rows = requireHealthy(t, code, out, errOut, 1)
	row = findRow(t, rows, "topology pgb")
	require.Contains(t, row.found, "2 servers")
	require.Contains(t, row.found, "through a pooler")
	require.Contains(t, row.found, replicapool.TopologyPooled.Cost())

	// A pool smaller than the sample: the later transactions wait for
	// server connections until the first ones give theirs back (maxHold),
	// and the check still ends and still sees both servers.
	small := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(r...), PoolSize: 2})
	began := time.Now()
	code, out, errOut = runCLI(t, e.args(c.Primary().DSN(""), "", "pgb="+small.DSN("postgres"))...)
	require.Less(t, time.Since(began), 8*time.Second)
	rows = requireHealthy(t, code, out, errOut, 1)
	require.Contains(t, findRow(t, rows, "topology pgb").found, "2 servers")

	// One standby behind PgBouncer: one server, but a pooler still
	// answers for it, so the router checks each transaction.
	one := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(r[0])})
	code, out, errOut = runCLI(t, e.args(c.Primary().DSN(""), "", "pgb1="+one.DSN("postgres"))...)
	rows = requireHealthy(t, code, out, errOut, 1)
	row = findRow(t, rows, "topology pgb1")
	require.Contains(t, row.found, fmt.Sprintf("1 server: 127.0.0.1:%d", r[0].Port()))
	require.Contains(t, row.found, replicapool.TopologyPooled.Cost())
}

// TestDoctorMissingGrants: on a hardened cluster (the control functions
// revoked from PUBLIC) a role without pg_monitor or pg_read_all_stats
// fails the grants rows and only those; the replication rows cannot see
// what the role may not (?), and the history row warns. Running the fix
// lines as printed makes every row pass.
func TestDoctorMissingGrants(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	p, r := c.Primary(), c.Replicas()
	require.NoError(t, p.Exec(ctx, "", "REVOKE EXECUTE ON FUNCTION pg_control_system(), pg_control_init() FROM PUBLIC"))
	require.NoError(t, p.Exec(ctx, "", "CREATE ROLE app LOGIN"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	e := newDoctorEnv(t)
	args := e.args(dsnAs("app", p), "", "r1="+dsnAs("app", r[0]), "r2="+dsnAs("app", r[1]))

	code, out, _ := runCLI(t, args...)
	t.Logf("role app without pg_read_all_stats or EXECUTE on the control functions, exit %d:\n%s", code, out)
	rows := requireFailing(t, code, out, []string{"grants primary", "grants r1", "grants r2"}, []string{"replication r1", "replication r2"})
	g := findRow(t, rows, "grants r1")
	require.Contains(t, g.found, `role "app" lacks EXECUTE on pg_control_system(), EXECUTE on pg_control_init(), pg_read_all_stats`)
	require.Equal(t, []string{"run on the primary (standbys replay it):",
		`GRANT EXECUTE ON FUNCTION pg_control_system() TO "app";`,
		`GRANT EXECUTE ON FUNCTION pg_control_init() TO "app";`,
		`GRANT pg_read_all_stats TO "app";`}, g.fix)
	require.Contains(t, findRow(t, rows, "replication r1").found, "system identifier, timeline, receiver status hidden")
	hist := findRow(t, rows, "history primary")
	require.Equal(t, "!", hist.mark)
	require.Contains(t, hist.found, "tokens from older timelines")
	require.Equal(t, []string{"to keep it, run on the primary:", `GRANT EXECUTE ON FUNCTION pg_read_file(text) TO "app";`}, hist.fix)

	// The fix, as printed.
	for _, f := range append(g.fix, hist.fix...) {
		if strings.HasPrefix(f, "GRANT ") {
			require.NoError(t, p.Exec(ctx, "", f))
		}
	}
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	code, out, errOut := runCLI(t, args...)
	t.Logf("after the printed GRANTs, exit %d:\n%s", code, out)
	rows = requireHealthy(t, code, out, errOut, 2)
	require.Contains(t, findRow(t, rows, "grants r2").found, `role "app" may call every function`)
}

// TestDoctorMissingConnect: a role without CONNECT on the database fails
// every node's reachable row with the GRANT that fixes it; run as printed,
// every node is reachable.
func TestDoctorMissingConnect(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := pgtest.NewDatabase(t, c)
	role := fmt.Sprintf("noconnect_%d", time.Now().UnixNano()%1e9)
	su := connectT(t, c.Primary().DSN(db))
	for _, sql := range []string{"CREATE ROLE " + role + " LOGIN", "REVOKE CONNECT ON DATABASE " + pgx.Identifier{db}.Sanitize() + " FROM PUBLIC"} {
		_, err := su.Exec(ctx, sql)
		require.NoError(t, err)
	}
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	dsn := func(n *pgtest.Node) string {
		return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", role, n.Port(), db)
	}
	r := c.Replicas()
	args := []string{"doctor", "--primary", dsn(c.Primary()), "--replica", "r1=" + dsn(r[0]), "--replica", "r2=" + dsn(r[1])}
	code, out, _ := runCLI(t, args...)
	t.Logf("a role without CONNECT, exit %d:\n%s", code, out)
	require.Equal(t, 1, code, out)
	rows := parseReport(t, out)
	want := []string{"run on the primary (standbys replay it):", fmt.Sprintf(`GRANT CONNECT ON DATABASE "%s" TO "%s";`, db, role)}
	for _, node := range []string{"primary", "r1", "r2"} {
		row := findRow(t, rows, "reachable "+node)
		require.Equal(t, "✗", row.mark, node)
		require.Contains(t, row.found, "permission denied for database")
		require.Equal(t, want, row.fix, node)
	}

	_, err := su.Exec(ctx, want[1])
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	code, out, _ = runCLI(t, args...)
	t.Logf("after the printed GRANT, exit %d:\n%s", code, out)
	rows = parseReport(t, out)
	for _, node := range []string{"primary", "r1", "r2"} {
		require.Equal(t, "✓", findRow(t, rows, "reachable "+node).mark, node)
	}
}

// TestDoctorForeignStandby: a standby of another cluster given as a
// replica fails its replication row, and only that.
func TestDoctorForeignStandby(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	other, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, other.Close()) })
	e := newDoctorEnv(t)
	code, out, _ := runCLI(t, e.args(c.Primary().DSN(""), "", "r1="+c.Replicas()[0].DSN(""), "other="+other.Replicas()[0].DSN(""))...)
	t.Logf("a standby of another cluster as a replica, exit %d:\n%s", code, out)
	rows := requireFailing(t, code, out, []string{"replication other"}, nil)
	ours, err := c.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)
	theirs, err := other.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)
	require.NotEqual(t, ours, theirs)
	require.Contains(t, findRow(t, rows, "replication other").found,
		fmt.Sprintf("system identifier %d, the primary's is %d: a standby of another cluster", theirs, ours))
}

// TestDoctorStoppedReceiver: a standby whose WAL receiver stopped (no
// primary_conninfo) fails its replication row, and only that.
func TestDoctorStoppedReceiver(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	r := c.Replicas()
	require.NoError(t, r[1].Exec(ctx, "", "ALTER SYSTEM SET primary_conninfo = ''"))
	require.NoError(t, r[1].Exec(ctx, "", "SELECT pg_reload_conf()"))
	conn := connectT(t, r[1].DSN(""))
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_wal_receiver").Scan(&n))
		return n == 0
	}, 30*time.Second, 20*time.Millisecond, "the WAL receiver stops")

	e := newDoctorEnv(t)
	code, out, _ := runCLI(t, e.args(c.Primary().DSN(""), "", "r1="+r[0].DSN(""), "r2="+r[1].DSN(""))...)
	t.Logf("a standby whose WAL receiver stopped, exit %d:\n%s", code, out)
	rows := requireFailing(t, code, out, []string{"replication r2"}, nil)
	row := findRow(t, rows, "replication r2")
	require.Contains(t, row.found, "no WAL receiver runs")
	require.Contains(t, strings.Join(row.fix, " "), "primary_conninfo")
}

// TestDoctorRedisACL: a Redis user that may not publish on the feed's
// channel fails the redis ACL row, and only that; the ACL SETUSER line
// printed as the fix (with the user's password) makes it pass.
func TestDoctorRedisACL(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	e := newDoctorEnv(t)
	admin := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
	defer admin.Close()
	ctx := context.Background()
	user := "doctor-" + e.feedName
	tag := "{caughtup.feed." + e.feedName + "}"
	// What a publisher needs, but PUBLISH and the channel.
	require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", user, "on", ">s3cret", "resetkeys", "resetchannels", "-@all",
		"~"+tag+":*", "+set", "+sadd", "+pexpire", "+ping").Err())
	t.Cleanup(func() { _ = admin.Do(context.Background(), "ACL", "DELUSER", user).Err() })

	r := c.Replicas()
	args := e.args(c.Primary().DSN(""), user+":s3cret", "r1="+r[0].DSN(""), "r2="+r[1].DSN(""))
	code, out, _ := runCLI(t, args...)
	t.Logf("a Redis user without PUBLISH, exit %d:\n%s", code, out)
	require.NotContains(t, out, "s3cret", "the password is never printed")
	rows := requireFailing(t, code, out, []string{"redis ACL "}, nil)
	row := findRow(t, rows, "redis ACL ")
	require.Contains(t, row.found, "NOPERM")
	setuser := row.fix[1]
	require.Equal(t, "ACL SETUSER "+user+" on >PASSWORD "+feed.PublisherACL(e.feedName), setuser)

	fix := []any{}
	for _, f := range strings.Fields(strings.Replace(setuser, ">PASSWORD", ">s3cret", 1)) {
		fix = append(fix, f)
	}
	require.NoError(t, admin.Do(ctx, fix...).Err())
	code, out, errOut := runCLI(t, args...)
	t.Logf("after the printed ACL SETUSER, exit %d:\n%s", code, out)
	requireHealthy(t, code, out, errOut, 2)
}

// TestDoctorEnvironment: without --redis and --keys-file the doctor
// reads $CAUGHTUP_REDIS_URL and $CAUGHTUP_FEED_KEYS, as caughtup feed
// does; without either Redis variable there is one "not configured" row.
func TestDoctorEnvironment(t *testing.T) {
	c := pgtest.Shared(t)
	e := newDoctorEnv(t)
	r := c.Replicas()
	base := []string{"doctor", "--primary", c.Primary().DSN(""), "--replica", r[0].DSN(""), "--feed", e.feedName}
	t.Setenv("CAUGHTUP_REDIS_URL", "redis://"+e.redis.Addr()+"/0")
	t.Setenv("CAUGHTUP_FEED_KEYS", e.keys[0].Export())
	code, out, errOut := runCLI(t, base...)
	rows := requireHealthy(t, code, out, errOut, 1)
	require.Contains(t, findRow(t, rows, "feed keys ").found, `signing with "k1"`)
	require.Contains(t, findRow(t, rows, "replication "+"127.0.0.1:"+strconv.Itoa(r[0].Port())).found, "streaming",
		"a bare URL is named host:port, as caughtup feed names it")

	t.Setenv("CAUGHTUP_REDIS_URL", "")
	code, out, _ = runCLI(t, base...)
	t.Logf("without Redis, exit %d:\n%s", code, out)
	require.Equal(t, 0, code, out)
	rows = parseReport(t, out)
	require.Equal(t, "i", findRow(t, rows, "redis ").mark)
	require.Contains(t, findRow(t, rows, "redis ").found, "not configured")
	for _, row := range rows {
		require.NotContains(t, []string{"feed keys", "redis ACL"}, row.check, "no Redis checks without Redis")
	}

	// Redis without keys: the feed would not start, and the ACL is not
	// probed with an unsigned message that routers would log as forged.
	t.Setenv("CAUGHTUP_REDIS_URL", "redis://"+e.redis.Addr()+"/0")
	t.Setenv("CAUGHTUP_FEED_KEYS", "")
	code, out, _ = runCLI(t, base...)
	requireFailing(t, code, out, []string{"feed keys "}, []string{"redis ACL "})
}

// TestDoctorWithoutFeed: a deployment without a position feed, Redis or
// not, passes: one "feed" row says the feed is not configured, and there
// are no feed keys or redis ACL rows. A flag only caughtup feed uses (here
// --interval, as in a feed's command line) configures it, and the missing
// keys then fail. doctor's help leaves out the feed flags it ignores.
func TestDoctorWithoutFeed(t *testing.T) {
	c := pgtest.Shared(t)
	e := newDoctorEnv(t)
	r := c.Replicas()
	t.Setenv("CAUGHTUP_REDIS_URL", "")
	t.Setenv("CAUGHTUP_FEED_KEYS", "")
	nodes := []string{"doctor", "--primary", c.Primary().DSN(""), "--replica", "r1=" + r[0].DSN(""), "--replica", "r2=" + r[1].DSN("")}
	for _, redisArgs := range [][]string{{"--redis", "redis://" + e.redis.Addr() + "/0"}, nil} {
		code, out, errOut := runCLI(t, append(slices.Clone(nodes), redisArgs...)...)
		t.Logf("no feed, redis %v, exit %d:\n%s", redisArgs, code, out)
		require.Equal(t, 0, code, "%s\n%s", out, errOut)
		require.Contains(t, out, "primary and 2 replica(s), no feed\n")
		rows := parseReport(t, out)
		count := map[string]int{}
		for _, row := range rows {
			require.Contains(t, []string{"✓", "i"}, row.mark, "row %s: %s", row.key(), row.found)
			count[row.check]++
		}
		require.Equal(t, map[string]int{"reachable": 3, "replication": 3, "topology": 2, "grants": 3, "history": 1, "clock": 1,
			"redis": 1, "feed": 1, "settings": 5}, count)
		f := findRow(t, rows, "feed ")
		require.Equal(t, "i", f.mark)
		require.Contains(t, f.found, "not configured")
		if redisArgs != nil {
			require.Contains(t, findRow(t, rows, "redis ").found, "answered PING")
		}
	}

	code, out, _ := runCLI(t, append(slices.Clone(nodes), "--redis", "redis://"+e.redis.Addr()+"/0", "--interval", "10ms", "--feed", e.feedName)...)
	t.Logf("a feed's flags without keys, exit %d:\n%s", code, out)
	rows := requireFailing(t, code, out, []string{"feed keys "}, []string{"redis ACL "})
	require.Contains(t, out, fmt.Sprintf("feed %q\n", e.feedName))
	for _, row := range rows {
		require.NotEqual(t, "feed", row.check, "a configured feed has no feed row")
	}

	code, help, _ := runCLI(t, "doctor", "--help")
	require.Equal(t, 0, code)
	_, feedHelp, _ := runCLI(t, "feed", "--help")
	shows := func(help, flag string) bool {
		return strings.Contains(help, "\n  -"+flag+" ") || strings.Contains(help, "\n  -"+flag+"\n")
	}
	for _, flag := range []string{"keys-file", "key-id", "insecure", "feed", "redis", "connections"} {
		require.True(t, shows(help, flag), "doctor --help shows -%s", flag)
	}
	for _, flag := range doctorIgnores {
		require.False(t, shows(help, flag), "doctor --help hides -%s, which it does not use", flag)
		require.True(t, shows(feedHelp, flag), "feed --help shows -%s", flag)
	}
	require.Contains(t, help, "The position feed is checked only when it is configured")
}

func TestDoctorRejectsBadFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{},
		{"--primary", "postgres://x/y"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--timeout", "0s"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--connections", "1"},
		{"--primary", "postgres://x/y", "--replica", "a=postgres://x/y", "--replica", "a=postgres://x/z"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--redis", "http://x"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--redis", "redis://x", "--redis-mode", "ring"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--keys-file", "/nonexistent/keys"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "--interval", "0s"},
		{"--primary", "postgres://x/y?connect_timeout=x", "--replica", "postgres://x/y"},
		{"--primary", "postgres://x/y", "--replica", "postgres://x/y", "extra"},
		{"--bogus"},
	} {
		code, _, errOut := runCLI(t, append([]string{"doctor"}, args...)...)
		require.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
}

// TestDoctorUnreachable: a node that refuses connections fails its
// reachable row with the error, and the checks that need it say so.
func TestDoctorUnreachable(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	code, out, _ := runCLI(t, "doctor", "--primary", c.Primary().DSN(""), "--replica", "r1="+c.Replicas()[0].DSN(""),
		"--replica", "gone=postgres://postgres@127.0.0.1:1/postgres?sslmode=disable", "--timeout", "5s")
	t.Logf("a replica URL nothing listens on, exit %d:\n%s", code, out)
	rows := requireFailing(t, code, out, []string{"reachable gone"}, []string{"replication gone", "topology gone", "grants gone"})
	require.Contains(t, findRow(t, rows, "reachable gone").found, "connection refused")
}

func TestClockRow(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		skew, rtt time.Duration
		want      mark
	}{
		{0, time.Millisecond, markPass},
		{900 * time.Millisecond, time.Millisecond, markPass},
		{1500 * time.Millisecond, 10 * time.Millisecond, markFail},
		{-1500 * time.Millisecond, 10 * time.Millisecond, markFail},
		{1200 * time.Millisecond, time.Second, markPass}, // within the round trip's uncertainty
	} {
		r := clockRow("primary", tc.skew, tc.rtt)
		require.Equal(t, tc.want, r.mark, "skew %v, rtt %v: %s", tc.skew, tc.rtt, r.found)
		require.Equal(t, tc.want == markFail, len(r.fix) > 0)
	}
}

func connectT(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	require.Equal(t, "redis://pub:xxxxx@r:6379/0", redactURL("redis://pub:s3cret@r:6379/0"))
	got := redactURL("redis://s:sent1nel@s1:26379/0?master_name=m&password=s3cret&sentinel_password=other&addr=s2:26379")
	require.NotContains(t, got, "s3cret")
	require.NotContains(t, got, "sent1nel")
	require.NotContains(t, got, "other")
	require.Contains(t, got, "master_name=m")
}
