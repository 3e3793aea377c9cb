package proxytest_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helperMain(mode))
	}
	goleak.VerifyTestMain(noLeftovers{pgtest.Wrap(m, pgtest.Options{Logf: verboseLogf})})
}

// verboseLogf shows the shared cluster's progress under -v only.
func verboseLogf(format string, args ...any) {
	if testing.Verbose() {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
	}
}

// noLeftovers fails the run when an haproxy or a pgbouncer that this test
// binary started still runs once every test has ended: each test must
// have stopped its own.
type noLeftovers struct{ m interface{ Run() int } }

func (n noLeftovers) Run() int {
	code := n.m.Run()
	if left := services(os.Getpid()); len(left) > 0 {
		fmt.Fprintf(os.Stderr, "proxytest: still running after the tests: %v\n", left)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// services lists the live haproxy and pgbouncer children of pid, as
// "name[pid]".
func services(pid int) []string {
	var found []string
	for _, k := range testsvc.ChildrenOf(pid) {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(k) + "/comm")
		if err != nil || !testsvc.Alive(k) {
			continue
		}
		if name := strings.TrimSpace(string(b)); name == "haproxy" || name == "pgbouncer" {
			found = append(found, fmt.Sprintf("%s[%d]", name, k))
		}
	}
	return found
}

// setup returns the shared cluster's two standbys, a fresh database and a
// context bounded well below the package's time budget.
func setup(t *testing.T) (replicas []*pgtest.Node, db string, ctx context.Context) {
	t.Helper()
	c := pgtest.Shared(t)
	db = pgtest.NewDatabase(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	replicas = c.Replicas()
	require.Len(t, replicas, 2, "the shared cluster has two standbys")
	return replicas, db, ctx
}

// dsnAt is a pgx URL for db through the proxy at addr.
func dsnAt(addr, db string) string {
	return "postgres://postgres@" + addr + "/" + db + "?sslmode=disable&connect_timeout=5"
}

// connect opens a connection that t closes when it ends.
func connect(ctx context.Context, t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// serverPort is the port of the server that runs q's next statement: the
// standby's own, whatever proxy is in between.
func serverPort(ctx context.Context, t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) int {
	t.Helper()
	var port int
	require.NoError(t, q.QueryRow(ctx, "SELECT inet_server_port()").Scan(&port))
	return port
}

// newConnectionPorts opens n connections one after the other, closing
// each, and returns the server port each reached.
func newConnectionPorts(ctx context.Context, t *testing.T, dsn string, n int) []int {
	t.Helper()
	ports := make([]int, n)
	for i := range ports {
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err, "connection %d", i)
		ports[i] = serverPort(ctx, t, conn)
		require.NoError(t, conn.Close(ctx))
	}
	return ports
}

func portOf(t *testing.T, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	port, err := strconv.Atoi(p)
	require.NoError(t, err)
	return port
}

func itoa(i int) string { return strconv.Itoa(i) }

// statUID is the owner of a /proc/<pid> directory: the process's uid.
func statUID(fi os.FileInfo) uint32 { return fi.Sys().(*syscall.Stat_t).Uid }
