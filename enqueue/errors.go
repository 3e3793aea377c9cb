package enqueue

import (
	"errors"
	"strconv"
)

// Sentinel causes, for errors.Is. Capture, ReplicaRead and Commit wrap them
// with the server's own error where there is one.
var (
	// ErrInTransaction: the connection is inside a transaction block. A
	// position read there is below the transaction's own commit record, so
	// a replica could pass it and still not show the write. Commit the
	// outermost transaction first, then capture. Commit returns it when
	// the pgx.Tx it was given was a savepoint (tx.Begin on a pgx.Tx).
	ErrInTransaction = errors.New("caughtup/enqueue: the connection is inside a transaction; capture after the outermost COMMIT has returned")

	// ErrPoolTx: Commit was given the transaction of pgxpool.Pool.Begin,
	// which hands its connection back to the pool as part of Commit, so
	// nothing can be read on it afterwards. Commit refuses it before
	// committing. Use InTx, or pool.Acquire then conn.Begin and Commit.
	ErrPoolTx = errors.New("caughtup/enqueue: a pgxpool.Tx returns its connection to the pool on commit, so the position cannot be read on it; use InTx, or begin the transaction on an acquired connection (pool.Acquire, conn.Begin)")

	// ErrNotPrimary: Capture ran on a server in recovery (a standby).
	// Only the primary that ran the write knows its position; use
	// ReplicaRead for a standby the code read from.
	ErrNotPrimary = errors.New("caughtup/enqueue: the server is a standby (in recovery); capture the position on the primary that ran the write, or use ReplicaRead for a replica you read from")

	// ErrTimelineUnknown: a standby did not say which timeline it is on:
	// its WAL receiver is not running (replaying from an archive, or
	// disconnected), or the role lacks pg_read_all_stats, without which
	// pg_stat_wal_receiver hides received_tli. A position without a
	// timeline cannot be compared safely across a failover.
	ErrTimelineUnknown = errors.New("caughtup/enqueue: the standby's timeline is unknown")

	// ErrNoReplayPosition: pg_last_wal_replay_lsn() was NULL on a server
	// in recovery (it has not replayed anything yet).
	ErrNoReplayPosition = errors.New("caughtup/enqueue: the standby has not replayed any WAL yet")
)

// CaptureError reports that the position of a transaction could not be
// captured. Branch on Committed:
//
//   - Committed true: COMMIT succeeded and the data is durable; only the
//     token is missing. Do not retry the transaction. Enqueue without a
//     token (consumers read that database from the primary), or capture
//     again on a connection to the same primary: any position read there
//     after this moment is at or past the commit.
//   - Committed false: Commit refused before anything became durable
//     (ErrPoolTx, or a savepoint that leaves the outer transaction open:
//     ErrInTransaction). Fix the call; the transaction is still the
//     caller's to roll back or commit.
//
// A failed COMMIT is not a CaptureError: Commit returns pgx's error as is.
type CaptureError struct {
	// Database is the capturer's logical database name.
	Database string
	// Committed reports whether the transaction committed.
	Committed bool
	// Err is the cause.
	Err error
}

func (e *CaptureError) Error() string {
	db := strconv.Quote(e.Database)
	if e.Committed {
		return "caughtup/enqueue: transaction on database " + db +
			" committed, but its position could not be read (do not retry the transaction; enqueue without a token or capture again on the primary): " +
			e.Err.Error()
	}
	return "caughtup/enqueue: nothing committed on database " + db + ": " + e.Err.Error()
}

func (e *CaptureError) Unwrap() error { return e.Err }
