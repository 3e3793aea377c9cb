// Package proxytest starts what stands between a replica pool and its
// servers in real deployments, for tests of code that must not assume
// one pool reaches one server: HAProxy balancing connections round robin
// over several standbys (a Kubernetes Service, LVS, a cloud reader
// endpoint), and PgBouncer in transaction pooling in front of one standby
// or, through its host list, several. testkit/fault's Proxy is the
// in-process piece beside them: one endpoint whose server moves (DNS, a
// virtual IP), refuses or cannot be reached.
//
//	c := pgtest.Shared(t)
//	r := c.Replicas()
//	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(r...)})
//	pool, err := pgxpool.New(ctx, "postgres://postgres@"+h.Addr()+"/"+db+"?sslmode=disable")
//	require.NoError(t, h.SetState(h.Server(0), proxytest.Maint)) // new connections: replica2 only
//
//	b := proxytest.StartPgBouncer(t, proxytest.PgBouncerConfig{Backends: proxytest.Addrs(r...)})
//	pool, err := pgxpool.New(ctx, b.DSN(db))
//
// Through either, `inet_server_port()` is the port of the standby a
// connection (or, through PgBouncer, a transaction) reached, not the
// proxy's: tests tell the servers apart by it.
//
// # PgBouncer 1.18 and a host list
//
// Each new server connection of a pool (one database and user) takes the
// next host of the comma-separated list, round robin; idle server
// connections are then reused last-released first (server_round_robin
// = 0) and handed to whichever client's transaction comes next, so one
// client connection's consecutive transactions can land on different
// standbys. The list shares one port, so for several Backends the harness
// listens for each on its own loopback address (127.0.0.2, 127.0.0.3, …)
// with a fault.Proxy that forwards to the standby; PgBouncer.Forwarders
// gives them to tests. PgBouncer does not skip a host it cannot reach
// ("all hosts must be available at all times", says its manual): a failed
// connection uses up that host's turn, the pool waits server_login_retry
// (15 s by default) before its next attempt, at the next host, and clients
// queue meanwhile for the server connections it has.
//
// # Processes
//
// haproxy and pgbouncer are Debian's packages (scripts/install-deps);
// $HAPROXY and $PGBOUNCER override where they are looked up. Each runs in
// the foreground in a testsvc.Sandbox of its own, so its watchdog kills it
// when the test binary dies however it dies; StartHAProxy and
// StartPgBouncer stop it when the test ends, and the SIGINT/SIGTERM
// handler of testkit/testsvc stops it on a signal. As root both run as
// testsvc.ServiceCredential's user (pgbouncer refuses root; haproxy
// needs nothing more). A service that cannot start fails the test with
// its log; it never skips it.
package proxytest
