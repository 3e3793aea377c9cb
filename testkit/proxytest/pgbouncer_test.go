package proxytest_test

import (
	"context"
	"net"
	"os"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/proxytest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// transactionPorts runs n transactions on each of clients connections at
// once and returns, per client connection, the server port each
// transaction ran on.
func transactionPorts(ctx context.Context, t *testing.T, dsn string, clients, n int) [][]int {
	t.Helper()
	conns := make([]*pgx.Conn, clients)
	for i := range conns {
		conns[i] = connect(ctx, t, dsn)
	}
	ports := make([][]int, clients)
	errs := make([]error, clients)
	var wg sync.WaitGroup
	for i, conn := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range n {
				var port int
				// Two statements, so that it is a transaction in the
				// pooler's sense and not a lone query.
				err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
					if err := tx.QueryRow(ctx, "SELECT inet_server_port()").Scan(&port); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, "SELECT pg_sleep(0.001)")
					return err
				})
				if err != nil {
					errs[i] = err
					return
				}
				ports[i] = append(ports[i], port)
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "client %d", i)
	}
	return ports
}

func distinct(ports []int) map[int]bool {
	m := map[int]bool{}
	for _, p := range ports {
		m[p] = true
	}
	return m
}

// In front of one standby every transaction of every client runs there.
func TestPgBouncerOneHost(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	b := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(r[1])})
	require.Nil(t, b.Forwarders(), "one host is reached directly")
	for i, ports := range transactionPorts(ctx, t, b.DSN(db), 3, 20) {
		require.Len(t, ports, 20)
		require.Equal(t, map[int]bool{r[1].Port(): true}, distinct(ports), "client %d", i)
	}
}

// With a host list, a client connection's consecutive transactions land
// on different standbys: three clients share two server connections, one
// on each host (round robin), so each transaction takes whichever server
// connection is free, and a client queued behind the others gets a
// different one from the one it just released.
func TestPgBouncerHostListSpreadsTransactions(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	b := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(r...), PoolSize: 2})
	require.Len(t, b.Forwarders(), 2)
	both := map[int]bool{r[0].Port(): true, r[1].Port(): true}
	var all []int
	moved := 0
	for i, ports := range transactionPorts(ctx, t, b.DSN(db), 3, 30) {
		require.Len(t, ports, 30)
		t.Logf("client %d: %v", i, ports)
		all = append(all, ports...)
		if len(distinct(ports)) == 2 {
			moved++
		}
	}
	require.Equal(t, both, distinct(all), "the host list reaches both standbys, by their own ports")
	require.Equal(t, 3, moved, "every client connection's transactions ran on both standbys")
}

// With PgBouncer's defaults, a client's next transaction runs on another
// standby as soon as another client's transaction has used a second server
// connection: idle server connections are reused last-released first.
func TestPgBouncerNextTransactionMoves(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	b := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(r...)})
	a, c := connect(ctx, t, b.DSN(db)), connect(ctx, t, b.DSN(db))

	tx, err := a.Begin(ctx)
	require.NoError(t, err)
	pa := serverPort(ctx, t, tx) // the first server connection: one host
	pc := serverPort(ctx, t, c)  // a's is busy, so a second: the other host
	require.NotEqual(t, pa, pc, "the second server connection goes to the next host of the list")
	require.Equal(t, map[int]bool{r[0].Port(): true, r[1].Port(): true}, distinct([]int{pa, pc}))
	require.NoError(t, tx.Commit(ctx)) // a's server connection is now the last released

	require.Equal(t, pa, serverPort(ctx, t, c), "c's next transaction runs where a's ran, on the other standby")
}

// Forwarders let a test change what PgBouncer reaches behind one host of
// its list; moving one moves the new server connections of that host.
func TestPgBouncerForwarderMoves(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	addrs := proxytest.Addrs(r...)
	b := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: addrs, PoolSize: 2})
	fw := b.Forwarders()
	require.Len(t, fw, 2)
	_, p0, err := net.SplitHostPort(fw[0].Addr())
	require.NoError(t, err)
	_, p1, err := net.SplitHostPort(fw[1].Addr())
	require.NoError(t, err)
	require.Equal(t, p0, p1, "the host list shares one port")
	require.Equal(t, addrs[0], fw[0].Target())

	fw[0].SetTarget(addrs[1])
	for i, ports := range transactionPorts(ctx, t, b.DSN(db), 3, 10) {
		require.Equal(t, map[int]bool{r[1].Port(): true}, distinct(ports), "client %d: both hosts of the list lead to the second standby", i)
	}
}

// PgBouncer 1.18 has no way to skip a host it cannot reach: it tries it in
// its turn, and clients then queue for the server connections it has
// instead of getting an error. server_login_retry (15 s by default) is the
// pause before the pool's next attempt.
func TestPgBouncerRefusedHost(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	b := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{
		Backends: proxytest.Addrs(r...),
		Settings: map[string]string{"server_login_retry": "0.2"},
	})
	fw := b.Forwarders()
	fw[1].Refuse()
	for i, ports := range transactionPorts(ctx, t, b.DSN(db), 3, 20) {
		require.Equal(t, map[int]bool{r[0].Port(): true}, distinct(ports), "client %d: every transaction on the reachable standby", i)
	}
	accepted, _, _ := fw[1].Stats()
	require.Positive(t, accepted, "PgBouncer tried the refused host")
	refused, _, _ := net.SplitHostPort(fw[1].Addr())
	log, err := os.ReadFile(b.LogPath())
	require.NoError(t, err)
	require.Regexp(t, `@`+regexp.QuoteMeta(refused)+`:\d+ closing because`, string(log))
}

// The console answers, and lists a server connection per host of the list.
func TestPgBouncerAdmin(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	b := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(r...)})
	a, c := connect(ctx, t, b.DSN(db)), connect(ctx, t, b.DSN(db))
	tx, err := a.Begin(ctx)
	require.NoError(t, err)
	serverPort(ctx, t, tx)
	serverPort(ctx, t, c)
	require.NoError(t, tx.Commit(ctx))

	admin := connect(ctx, t, b.AdminDSN())
	rows, err := admin.Query(ctx, "SHOW SERVERS", pgx.QueryExecModeSimpleProtocol)
	require.NoError(t, err)
	maps, err := pgx.CollectRows(rows, pgx.RowToMap)
	require.NoError(t, err)
	hosts := map[string]bool{}
	for _, m := range maps {
		if m["database"] == db {
			hosts[m["addr"].(string)] = true
		}
	}
	fw := b.Forwarders()
	h0, _, _ := net.SplitHostPort(fw[0].Addr())
	h1, _, _ := net.SplitHostPort(fw[1].Addr())
	require.Equal(t, map[string]bool{h0: true, h1: true}, hosts, "SHOW SERVERS: %v", maps)
}

// Close stops pgbouncer and its forwarders and removes its directory.
func TestPgBouncerClose(t *testing.T) {
	t.Parallel()
	b, err := proxytest.NewPgBouncer(t.Context(), proxytest.PgBouncerConfig{Backends: []string{"127.0.0.1:1", "127.0.0.1:2"}})
	require.NoError(t, err)
	pid, dir := b.PID(), b.Dir()
	require.Equal(t, []int{pid}, testsvc.ProcessesIn([]string{dir}), "pgbouncer runs in its sandbox, where the watchdog looks")
	if os.Geteuid() == 0 {
		st, err := os.Stat("/proc/" + itoa(pid))
		require.NoError(t, err)
		require.NotZero(t, statUID(st), "pgbouncer refuses root: it runs as the service user")
	}
	require.NoError(t, b.Close())
	require.NoError(t, b.Close(), "idempotent")
	require.False(t, testsvc.Alive(pid))
	_, err = os.Stat(dir)
	require.True(t, os.IsNotExist(err), "%s removed: %v", dir, err)
	for _, addr := range []string{b.Addr(), b.Forwarders()[0].Addr()} {
		_, err = net.DialTimeout("tcp", addr, time.Second)
		require.Error(t, err, addr)
	}
}

func TestPgBouncerConfigErrors(t *testing.T) {
	t.Parallel()
	_, err := proxytest.NewPgBouncer(t.Context(), proxytest.PgBouncerConfig{})
	require.ErrorContains(t, err, "Backends is empty")
	_, err = proxytest.NewPgBouncer(t.Context(), proxytest.PgBouncerConfig{Backends: []string{"127.0.0.1:1"}, PoolMode: "nonsense"})
	require.ErrorContains(t, err, "exited during startup", "pgbouncer's own complaint, with its log")
}
