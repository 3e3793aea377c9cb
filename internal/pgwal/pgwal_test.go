package pgwal_test

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctxT(t), dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func TestReadPrimary(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx := ctxT(t)
	sys, err := c.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)
	conn := connect(t, c.Primary().DSN(""))

	p, err := pgwal.ReadPrimary(ctx, conn, pgwal.Control)
	require.NoError(t, err)
	require.Equal(t, position.Epoch{SystemID: sys, Timeline: 1}, p.Epoch())
	require.NotZero(t, p.InsertLSN)
	require.Equal(t, uint64(8), p.Control.WAL.MaxAlign)
	require.Equal(t, uint64(8192), p.Control.WAL.BlockSize)
	require.Equal(t, uint64(16<<20), p.Control.WAL.SegmentSize)
	require.LessOrEqual(t, p.InsertEnd(), p.InsertLSN)
	require.GreaterOrEqual(t, p.InsertEnd()+40, p.InsertLSN)

	q, err := pgwal.ReadPrimary(ctx, conn, 0)
	require.NoError(t, err)
	require.Zero(t, q.Control, "the control file is read only when asked for")

	// Without Status a replica read has no incarnation.
	plain, err := pgwal.ReadReplica(ctx, connect(t, c.Replicas()[0].DSN("")), 0)
	require.NoError(t, err)
	require.True(t, plain.InRecovery)
	require.True(t, plain.PostmasterStart.IsZero())
	require.NotZero(t, plain.Timeline)
	require.Equal(t, uint32(1), q.Timeline)
	require.GreaterOrEqual(t, q.InsertLSN, p.InsertLSN)

	_, err = pgwal.ReadPrimary(ctx, connect(t, c.Replicas()[0].DSN("")), 0)
	require.ErrorIs(t, err, pgwal.ErrInRecovery)
}

func TestReadReplica(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx := ctxT(t)
	sys, err := c.Primary().SystemIdentifier(ctx)
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))

	r, err := pgwal.ReadReplica(ctx, connect(t, c.Replicas()[0].DSN("")), pgwal.Control|pgwal.Status)
	require.NoError(t, err)
	require.True(t, r.InRecovery)
	require.True(t, r.ReceiverRunning)
	require.Equal(t, position.Epoch{SystemID: sys, Timeline: 1}, r.Replayed().Epoch)
	require.NotZero(t, r.LSN)
	require.False(t, r.PostmasterStart.IsZero())
	require.False(t, r.RecoveryStart.Before(r.PostmasterStart), "the startup process starts after the postmaster")
	require.WithinDuration(t, time.Now(), r.PostmasterStart, time.Hour)
	if r.TimeLagKnown {
		require.False(t, r.ReplayTimestamp.IsZero())
	}

	// A server that is not in recovery answers like ReadPrimary.
	p, err := pgwal.ReadReplica(ctx, connect(t, c.Primary().DSN("")), pgwal.Status)
	require.NoError(t, err)
	require.False(t, p.InRecovery)
	require.False(t, p.ReceiverRunning)
	require.Equal(t, uint32(1), p.Timeline)
	require.NotZero(t, p.LSN)
	require.Zero(t, p.Control)
	require.True(t, p.RecoveryStart.IsZero(), "no startup process outside recovery")
}

// A role without pg_read_all_stats sees the receiver but not its timeline,
// nor the startup process's start, and may not read history files.
func TestReadWithoutPrivileges(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx := ctxT(t)
	role := fmt.Sprintf("pgwal_plain_%d", time.Now().UnixNano())
	require.NoError(t, c.Primary().Exec(ctx, "", "CREATE ROLE "+role+" LOGIN"))
	t.Cleanup(func() { _ = c.Primary().Exec(context.Background(), "", "DROP ROLE "+role) })
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	dsn := func(n *pgtest.Node) string {
		return fmt.Sprintf("postgres://%s@127.0.0.1:%d/postgres?sslmode=disable", role, n.Port())
	}

	r, err := pgwal.ReadReplica(ctx, connect(t, dsn(c.Replicas()[0])), pgwal.Control|pgwal.Status)
	require.NoError(t, err)
	require.True(t, r.InRecovery)
	require.True(t, r.ReceiverRunning)
	require.Zero(t, r.Timeline, "received_tli is hidden without pg_read_all_stats")
	require.True(t, r.RecoveryStart.IsZero())
	require.False(t, r.PostmasterStart.IsZero())

	_, err = pgwal.ReadHistory(ctx, connect(t, dsn(c.Primary())), 2)
	require.ErrorIs(t, err, pgwal.ErrHistoryDenied)
	h, err := pgwal.ReadHistory(ctx, connect(t, dsn(c.Primary())), 1)
	require.NoError(t, err, "timeline 1 has no history to read")
	require.Empty(t, h)
	_, err = pgwal.ReadHistory(ctx, connect(t, c.Primary().DSN("")), 2)
	require.Error(t, err, "no such file on timeline 1")
	require.NotErrorIs(t, err, pgwal.ErrHistoryDenied)
}

// The incarnation changes when the replica restarts, and also when its
// postmaster survives a backend crash and reinitializes, which restarts
// replay from the last restartpoint.
func TestIncarnation(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	n := c.Replicas()[0]
	read := func() pgwal.Replica {
		t.Helper()
		var r pgwal.Replica
		require.Eventually(t, func() bool {
			conn, err := pgx.Connect(ctx, n.DSN(""))
			if err != nil {
				return false
			}
			defer conn.Close(context.Background())
			r, err = pgwal.ReadReplica(ctx, conn, pgwal.Status)
			return err == nil
		}, 30*time.Second, 10*time.Millisecond)
		return r
	}
	first := read()
	again := read()
	require.Equal(t, first.PostmasterStart, again.PostmasterStart)
	require.Equal(t, first.RecoveryStart, again.RecoveryStart)

	// A backend killed by SIGKILL makes the postmaster reinitialize.
	conn, err := pgx.Connect(ctx, n.DSN(""))
	require.NoError(t, err)
	var pid int32
	require.NoError(t, conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	require.NoError(t, syscall.Kill(int(pid), syscall.SIGKILL))
	_ = conn.Close(context.Background())
	var second pgwal.Replica
	require.Eventually(t, func() bool {
		second = read()
		return second.RecoveryStart.After(first.RecoveryStart)
	}, 30*time.Second, 10*time.Millisecond, "the startup process restarted")
	require.Equal(t, first.PostmasterStart, second.PostmasterStart, "the postmaster survived")

	require.NoError(t, n.Kill())
	require.NoError(t, n.Start(ctx))
	third := read()
	require.True(t, third.PostmasterStart.After(second.PostmasterStart))
	require.True(t, third.RecoveryStart.After(second.RecoveryStart))
}

func TestParseTimeline(t *testing.T) {
	t.Parallel()
	v, err := pgwal.ParseTimeline("12")
	require.NoError(t, err)
	require.Equal(t, uint32(12), v)
	for _, bad := range []string{"", "0", "-1", "x", "4294967296"} {
		_, err := pgwal.ParseTimeline(bad)
		require.Error(t, err, bad)
	}
}

// TimeLag counts only while received WAL waits to be replayed: a replica
// that has replayed everything on an idle primary has none, however old
// its last transaction, and one whose replay is paused behind a commit has
// the age of the last transaction it did replay.
func TestReplicaTimeLag(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	primary, replica := c.Primary(), c.Replicas()[0]
	require.NoError(t, primary.Exec(ctx, "", "CREATE TABLE t (id int)"))
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	conn := connect(t, replica.DSN(""))

	// Idle: the last transaction grows old, nothing is left to replay.
	// Background records (a standby snapshot, a checkpoint) may be in
	// flight at one reading, never at all of them.
	const idle = 1500 * time.Millisecond
	time.Sleep(idle)
	var r pgwal.Replica
	require.Eventually(t, func() bool {
		r, err = pgwal.ReadReplica(ctx, conn, pgwal.Status)
		require.NoError(t, err)
		return r.TimeLagKnown && r.TimeLag == 0
	}, 10*time.Second, 10*time.Millisecond, "idle and caught up, yet the time lag never read 0")
	require.GreaterOrEqual(t, time.Since(r.ReplayTimestamp), idle, "the last replayed transaction is old")

	// Paused behind a commit: the lag is the age of the last transaction
	// replayed, at least the idle time before it.
	require.NoError(t, replica.PauseReplay(ctx))
	t.Cleanup(func() { _ = replica.ResumeReplay(context.Background()) })
	require.NoError(t, primary.Exec(ctx, "", "INSERT INTO t VALUES (1)"))
	var received bool
	require.Eventually(t, func() bool {
		require.NoError(t, conn.QueryRow(ctx, "SELECT pg_last_wal_receive_lsn() > pg_last_wal_replay_lsn()").Scan(&received))
		return received
	}, 10*time.Second, 10*time.Millisecond, "the commit never reached the replica")
	r, err = pgwal.ReadReplica(ctx, conn, pgwal.Status)
	require.NoError(t, err)
	require.True(t, r.TimeLagKnown)
	require.GreaterOrEqual(t, r.TimeLag, idle)
}

// BeginReadReplica reads what ReadReplica reads as the first statement of
// a transaction it leaves open, and Backend names the server process,
// which on a direct connection is the one the key data named.
func TestBeginReadReplica(t *testing.T) {
	t.Parallel()
	c := pgtest.Shared(t)
	ctx := ctxT(t)
	conn := connect(t, c.Replicas()[0].DSN(""))
	all := pgwal.Control | pgwal.Status | pgwal.Backend

	plain, err := pgwal.ReadReplica(ctx, conn, all)
	require.NoError(t, err)
	require.Equal(t, conn.PgConn().PID(), plain.BackendPID)
	require.Equal(t, byte('I'), conn.PgConn().TxStatus())

	in, err := pgwal.BeginReadReplica(ctx, conn.PgConn(), all)
	require.NoError(t, err)
	require.Equal(t, byte('T'), conn.PgConn().TxStatus(), "the transaction stays open")
	require.Equal(t, plain.Replayed().Epoch, in.Replayed().Epoch)
	require.GreaterOrEqual(t, in.LSN, plain.LSN)
	require.Equal(t, plain.PostmasterStart, in.PostmasterStart)
	require.Equal(t, plain.RecoveryStart, in.RecoveryStart)
	require.Equal(t, plain.Control, in.Control)
	require.Equal(t, plain.BackendPID, in.BackendPID)
	require.Equal(t, plain.ReceiverRunning, in.ReceiverRunning)
	var iso string
	require.NoError(t, conn.QueryRow(ctx, "SHOW transaction_isolation").Scan(&iso))
	require.Equal(t, "read committed", iso)
	_, err = conn.Exec(ctx, "ROLLBACK")
	require.NoError(t, err)

	// Fewer fields scan as well; on a primary the row is ReadPrimary's.
	p, err := pgwal.BeginReadReplica(ctx, connect(t, c.Primary().DSN("")).PgConn(), 0)
	require.NoError(t, err)
	require.False(t, p.InRecovery)
	require.Equal(t, uint32(1), p.Timeline)
	require.NotZero(t, p.LSN)
	require.Zero(t, p.BackendPID)
}
