package enqueue_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

// Commit a transaction on an acquired connection, then enqueue with the
// token the context now carries.
func ExampleCommit() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@primary/app")
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	conn, err := pool.Acquire(ctx) // not pool.Begin: see ErrPoolTx
	if err != nil {
		panic(err)
	}
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "INSERT INTO users (email) VALUES ($1)", "a@example.com"); err != nil {
		panic(err)
	}

	ctx, err = enqueue.Commit(ctx, tx)
	var ce *enqueue.CaptureError
	if errors.As(err, &ce) && ce.Committed {
		// The user exists; only the token is missing. Enqueue anyway: the
		// job will read "main" from the primary.
	} else if err != nil {
		panic(err)
	}

	tok, _ := enqueue.TokenFrom(ctx)
	header, _ := tok.Encode()
	fmt.Println(position.HeaderName, header) // what the queue adapter attaches
}

// InTx acquires a connection, runs the function in a transaction, commits
// and captures on the same connection.
func ExampleInTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@primary/app")
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	ctx, err = enqueue.InTx(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE accounts SET plan = 'pro' WHERE id = $1", 42)
		return err
	})
	if err != nil {
		panic(err)
	}
	_ = ctx // hand ctx to the queue client
}

// Several writes before one enqueue merge into one token: per database the
// furthest position, and the oldest capture time. Two logical databases,
// each with its own Capturer in a real program, share the token.
func ExampleWithToken() {
	epoch := position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}
	at := time.UnixMilli(1764417600000)

	ctx := context.Background()
	ctx = enqueue.WithToken(ctx, position.New("main", epoch, position.MustParseLSN("0/16B3740"), position.SourcePrimary, at))
	ctx = enqueue.WithToken(ctx, position.New("main", epoch, position.MustParseLSN("0/16B3000"), position.SourceReplica, at.Add(time.Second)))
	ctx = enqueue.WithToken(ctx, position.New("ci", epoch, position.MustParseLSN("3/0"), position.SourcePrimary, at.Add(2*time.Second)))

	tok, _ := enqueue.TokenFrom(ctx)
	for _, e := range tok.Entries {
		fmt.Println(e.Database, e.LSN, e.Source)
	}
	fmt.Println(tok.CapturedAt.Equal(at))
	fmt.Println(tok)
	// Output:
	// ci 3/0 primary
	// main 0/16B3740 primary
	// true
	// v1;mik8olc0;ci=p.6f1e2d3c4b5a6978.1.3/0;main=p.6f1e2d3c4b5a6978.1.0/16B3740
}

// A session collects positions from code that drops the returned context.
func ExampleWithSession() {
	epoch := position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}
	createUser := func(ctx context.Context) {
		// enqueue.InTx(ctx, pool, ...) would do this; the caller never sees
		// the context it returns.
		_ = enqueue.WithToken(ctx, position.New("main", epoch, position.MustParseLSN("0/2000"), position.SourcePrimary, time.Time{}))
	}

	ctx := enqueue.WithSession(context.Background())
	createUser(ctx)
	tok, ok := enqueue.TokenFrom(ctx)
	fmt.Println(ok, tok.Entries[0].LSN)
	// Output:
	// true 0/2000
}
