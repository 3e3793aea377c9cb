package proxytest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// PgBouncerConfig configures a PgBouncer whose every database (a `*`
// entry) is the database of the same name on Backends, reached as user
// postgres without a password (the pgtest clusters trust loopback).
type PgBouncerConfig struct {
	// Backends are the servers, as host:port. Required. With one,
	// PgBouncer connects to it directly. With several, they become the
	// comma-separated host list of PgBouncer ≥ 1.17: each new server
	// connection goes to the next host of the list, round robin, counted
	// per pool (per database and user); see Forwarders for how they are
	// reached.
	Backends []string
	// PoolMode is pool_mode. Default: "transaction", where a client's
	// consecutive transactions may run on different server connections,
	// and so on different servers behind a host list.
	PoolMode string
	// PoolSize is default_pool_size, the server connections per pool.
	// Default: 20, PgBouncer's own.
	PoolSize int
	// ServerRoundRobin sets server_round_robin = 1: idle server connections
	// are reused in turn instead of last-released first. Default: false,
	// PgBouncer's LIFO, under which a lone client tends to get the same
	// server connection back.
	ServerRoundRobin bool
	// Settings are extra [pgbouncer] settings, written verbatim after the
	// harness's, e.g. {"server_lifetime": "1"}.
	Settings map[string]string
}

// PgBouncer is a running pgbouncer.
type PgBouncer struct {
	*service
	forwarders []*fault.Proxy
}

// StartPgBouncer starts a PgBouncer for t and stops it when t ends. It
// fails t, never skips it, when pgbouncer cannot start.
func StartPgBouncer(t testing.TB, cfg PgBouncerConfig) *PgBouncer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := NewPgBouncer(ctx, cfg)
	if err != nil {
		t.Fatalf("proxytest: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("proxytest: %v", err)
		}
	})
	return b
}

// NewPgBouncer starts a PgBouncer on a free loopback port; the caller
// closes it. StartPgBouncer is the form for tests. PgBouncer refuses to
// run as root, so as root it runs as testsvc.ServiceCredential's user.
func NewPgBouncer(ctx context.Context, cfg PgBouncerConfig) (*PgBouncer, error) {
	if len(cfg.Backends) == 0 {
		return nil, errors.New("proxytest: PgBouncerConfig.Backends is empty")
	}
	bin, ok := testsvc.FindBinary("PGBOUNCER", "pgbouncer", "/usr/sbin/pgbouncer")
	if !ok {
		return nil, errors.New("proxytest: pgbouncer not found ($PGBOUNCER, $PATH, /usr/sbin); is pgbouncer installed? run scripts/install-deps")
	}
	b := &PgBouncer{}
	host, port := "", ""
	if len(cfg.Backends) == 1 {
		var err error
		if host, port, err = net.SplitHostPort(cfg.Backends[0]); err != nil {
			return nil, fmt.Errorf("proxytest: PgBouncerConfig.Backends: %w", err)
		}
	} else {
		fw, err := forwarders(cfg.Backends)
		if err != nil {
			return nil, err
		}
		b.forwarders = fw
		hosts := make([]string, len(fw))
		for i, p := range fw {
			hosts[i], port, _ = net.SplitHostPort(p.Addr())
		}
		host = strings.Join(hosts, ",")
	}
	s, err := startService(ctx, spec{
		name: "pgbouncer",
		bin:  bin,
		files: func(dir string, listen int) (map[string]string, []string) {
			return map[string]string{
				"pgbouncer.ini": pgbouncerConf(dir, listen, host, port, cfg),
				// trust still requires the user to be listed.
				"userlist.txt": `"postgres" ""` + "\n",
			}, []string{filepath.Join(dir, "pgbouncer.ini")}
		},
		ready: func(ctx context.Context, s *service) error {
			// It listens before it enters its event loop, and a failed
			// bind ends the process instead.
			return dialable(ctx, s.Addr())
		},
	})
	if err != nil {
		b.closeForwarders()
		return nil, err
	}
	b.service = s
	return b, nil
}

// forwarders puts a fault.Proxy in front of each backend, all on one port
// and each on its own loopback address (127.0.0.2, 127.0.0.3, …): a
// PgBouncer host list takes one port for every host (db->port in 1.18's
// source; 1.24's manual still says so), while pgtest's standbys share 127.0.0.1 on different ports.
// The forwarders open a TCP connection of their own to the standby, so
// inet_server_port() still reports the standby's port.
func forwarders(backends []string) ([]*fault.Proxy, error) {
	if len(backends) > 250 {
		return nil, errors.New("proxytest: at most 250 PgBouncer backends")
	}
	var last error
	for range 5 {
		port, fd, err := testsvc.PickPort()
		if err != nil {
			return nil, err
		}
		// PickPort keeps the port from every other harness of this
		// process; the hold on 127.0.0.1 is not needed.
		testsvc.UnholdPort(&fd)
		var fw []*fault.Proxy
		for i, addr := range backends {
			p, err := fault.ListenProxy(fmt.Sprintf("127.0.0.%d:%d", i+2, port), addr)
			if err != nil {
				last = err
				break
			}
			fw = append(fw, p)
		}
		if len(fw) == len(backends) {
			return fw, nil
		}
		for _, p := range fw {
			_ = p.Close()
		}
	}
	return nil, fmt.Errorf("proxytest: no port free on 127.0.0.2-%d for PgBouncer's host list: %w", len(backends)+1, last)
}

func pgbouncerConf(dir string, listen int, host, port string, cfg PgBouncerConfig) string {
	mode := cfg.PoolMode
	if mode == "" {
		mode = "transaction"
	}
	poolSize := cfg.PoolSize
	if poolSize == 0 {
		poolSize = 20
	}
	rr := 0
	if cfg.ServerRoundRobin {
		rr = 1
	}
	var b strings.Builder
	fmt.Fprintf(&b, `; Written by proxytest.
[databases]
; Every database name maps to the same name on the backends.
* = host=%s port=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
; TCP only: no socket file in /tmp to collide with another test's.
unix_socket_dir =
auth_type = trust
auth_file = %s
; The console (database "pgbouncer": SHOW SERVERS, RECONNECT, …).
admin_users = postgres
pool_mode = %s
default_pool_size = %d
server_round_robin = %d
; lib/pq and JDBC send it; PgBouncer refuses unknown startup parameters.
ignore_startup_parameters = extra_float_digits
`, host, port, listen, filepath.Join(dir, "userlist.txt"), mode, poolSize, rr)
	keys := make([]string, 0, len(cfg.Settings))
	for k := range cfg.Settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "%s = %s\n", k, cfg.Settings[k])
	}
	return b.String()
}

// DSN is a pgx URL for database through PgBouncer. It asks pgx for the
// simple protocol: pgx otherwise prepares named statements on one server
// connection and runs them on whichever the next transaction gets, which
// PgBouncer 1.18 in transaction pooling does not support (1.21 added
// max_prepared_statements).
func (b *PgBouncer) DSN(database string) string {
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&default_query_exec_mode=simple_protocol", b.Addr(), url.PathEscape(database))
}

// AdminDSN is the DSN of PgBouncer's console, for SHOW SERVERS, SHOW
// POOLS, RECONNECT and the like.
func (b *PgBouncer) AdminDSN() string { return b.DSN("pgbouncer") }

// Forwarders are the fault.Proxy in front of each backend, in Backends'
// order, when there are several (nil with one): Refuse, Blackhole or
// SetTarget on one changes what PgBouncer's new server connections to that
// host of the list find. PgBouncer 1.18 does not skip a host it cannot
// reach: a failed attempt uses up that host's turn, and the pool's next
// attempt, server_login_retry later, takes the next host.
func (b *PgBouncer) Forwarders() []*fault.Proxy { return append([]*fault.Proxy(nil), b.forwarders...) }

// Close stops PgBouncer, then its forwarders; idempotent.
func (b *PgBouncer) Close() error {
	err := b.service.Close()
	b.closeForwarders()
	return err
}

func (b *PgBouncer) closeForwarders() {
	for _, p := range b.forwarders {
		_ = p.Close()
	}
}
