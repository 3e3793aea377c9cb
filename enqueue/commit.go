package enqueue

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Commit commits tx and, if COMMIT succeeded, captures the position on the
// transaction's connection (Capture) and returns ctx carrying the token
// merged with any token ctx already had (WithToken).
//
//   - COMMIT failed (including pgx.ErrTxCommitRollback for a transaction
//     that had failed): pgx's error and ctx unchanged. Nothing committed.
//   - COMMIT succeeded but the capture failed: ctx unchanged and a
//     *CaptureError with Committed true. Do not retry the transaction.
//
// The connection must still belong to the caller after COMMIT: a
// transaction from pgx.Conn.Begin or pgxpool.Conn.Begin. A *pgxpool.Tx
// (pgxpool.Pool.Begin) returns its connection to the pool inside Commit,
// where another goroutine may already be using it, so Commit refuses it
// with ErrPoolTx before committing; use InTx instead. A savepoint (Begin on
// a pgx.Tx) is released, but since the outer transaction is still open
// Commit then returns a CaptureError with Committed false wrapping
// ErrInTransaction.
func (c *Capturer) Commit(ctx context.Context, tx pgx.Tx) (context.Context, error) {
	if _, ok := tx.(*pgxpool.Tx); ok {
		return ctx, &CaptureError{Database: c.cfg.Database, Err: ErrPoolTx}
	}
	conn := tx.Conn()
	if conn == nil {
		return ctx, &CaptureError{Database: c.cfg.Database, Err: errors.New("the transaction has no connection")}
	}
	if err := tx.Commit(ctx); err != nil {
		return ctx, err
	}
	if s := conn.PgConn().TxStatus(); s == 'T' || s == 'E' {
		return ctx, &CaptureError{Database: c.cfg.Database, Err: ErrInTransaction}
	}
	tok, err := c.Capture(ctx, conn)
	if err != nil {
		return ctx, &CaptureError{Database: c.cfg.Database, Committed: true, Err: err}
	}
	return WithToken(ctx, tok), nil
}

// InTx runs fn in a transaction on one connection acquired from pool,
// commits, captures the position on that same connection, releases it, and
// returns ctx carrying the merged token. It is InTxOptions with the zero
// pgx.TxOptions.
//
// If fn returns an error or panics the transaction is rolled back and
// InTx returns fn's error (or re-panics) with ctx unchanged. The results
// of COMMIT and capture are those of Commit.
func (c *Capturer) InTx(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) error) (context.Context, error) {
	return c.InTxOptions(ctx, pool, pgx.TxOptions{}, fn)
}

// InTxOptions is InTx with transaction options (isolation level, access
// mode, ...).
func (c *Capturer) InTxOptions(ctx context.Context, pool *pgxpool.Pool, opts pgx.TxOptions, fn func(pgx.Tx) error) (context.Context, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return ctx, err
	}
	// Release after the deferred rollback below, so a connection whose
	// rollback failed is closed by then and destroyed, not reused.
	defer conn.Release()
	tx, err := conn.BeginTx(ctx, opts)
	if err != nil {
		return ctx, err
	}
	defer func() {
		// After Commit this is a no-op returning ErrTxClosed; after fn's
		// error or panic it rolls back. A rollback that fails (ctx done)
		// closes the connection, and Release then destroys it.
		_ = tx.Rollback(ctx)
	}()
	if err := fn(tx); err != nil {
		return ctx, err
	}
	return c.Commit(ctx, tx)
}

// defaultCapturer serves the package-level functions.
var defaultCapturer = NewCapturer(Config{})

// Commit is Capturer.Commit for the logical database "main" with the
// default Config.
func Commit(ctx context.Context, tx pgx.Tx) (context.Context, error) {
	return defaultCapturer.Commit(ctx, tx)
}

// InTx is Capturer.InTx for the logical database "main" with the default
// Config.
func InTx(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) error) (context.Context, error) {
	return defaultCapturer.InTx(ctx, pool, fn)
}
