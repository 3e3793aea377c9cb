package consume_test

import (
	"context"
	"database/sql"
	"errors"
	"log"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// A handler written against database/sql (as with GORM, sqlx, ent, bun or
// sqlc's database/sql mode) asks SQLDB for the *sql.DB over the pool the
// router chose for this job: a replica that has replayed the job's
// token, or the primary. It needs no other change.
func ExampleSQLDB() {
	ctx := context.Background()
	primary, _ := pgxpool.New(ctx, "postgres://app@primary/app")
	replica, _ := pgxpool.New(ctx, "postgres://app@replica/app")
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replica)}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	handle := func(ctx context.Context, userID int64) error {
		db, err := consume.SQLDB(ctx, "main")
		if err != nil {
			return err // consume.ErrNotRouted or consume.ErrUnknownDatabase: a wiring mistake
		}
		var email string
		err = db.QueryRowContext(ctx, "SELECT email FROM users WHERE id = $1", userID).Scan(&email)
		if errors.Is(err, sql.ErrNoRows) {
			return nil // a write lost in a failover: see the package documentation
		}
		return err
	}

	// What a queue adapter does per job: route with the job's token, run
	// the handler with the context Route returns.
	header := "v1;…" // the job's caughtup-token header (position.HeaderName)
	tok, decodeErr := position.DecodeHeaders(header)
	jobCtx, _, err := router.Route(ctx, consume.Job{Token: tok, TokenErr: decodeErr, Policy: consume.Delayed})
	var de *consume.DeferError
	if errors.As(err, &de) {
		log.Printf("no replica has the job's writes yet; run it again in %v", de.Delay)
		return
	}
	if err := handle(jobCtx, 42); err != nil {
		log.Print(err)
	}
}
