package caughtupasynq_test

import (
	"context"
	"log"
	"strconv"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
)

// A worker and a producer in one process: the router built from the
// application's pools, a server whose handler reads a replica that has the
// producer's write, and a producer that commits, then enqueues with the
// context the commit returned. It needs a primary with streaming replicas
// and Redis, so it is compiled, not run.
func Example() {
	ctx := context.Background()
	primary, err := pgxpool.New(ctx, "postgres://app@primary/app")
	if err != nil {
		log.Fatal(err)
	}
	defer primary.Close()
	replica, err := pgxpool.New(ctx, "postgres://app@replica1/app")
	if err != nil {
		log.Fatal(err)
	}
	defer replica.Close()

	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replica)}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	redisOpt := asynq.RedisClientOpt{Addr: "localhost:6379"}
	srv, err := caughtupasynq.NewServer(redisOpt, asynq.Config{Concurrency: 10}, router, caughtupasynq.MiddlewareConfig{
		Policies: map[string]consume.Policy{"email:": consume.Delayed},
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := asynq.NewServeMux()
	mux.HandleFunc("email:welcome", func(ctx context.Context, t *asynq.Task) error {
		var email string // on a replica that has the producer's write, or the primary
		return consume.DB(ctx, "main").QueryRow(ctx, "SELECT email FROM users WHERE id = $1", string(t.Payload())).Scan(&email)
	})
	if err := srv.Start(mux); err != nil {
		log.Fatal(err)
	}
	defer srv.Shutdown()

	asynqClient := asynq.NewClient(redisOpt)
	defer asynqClient.Close()
	client := caughtupasynq.NewClient(asynqClient)
	var id int64
	ctx, err = enqueue.InTx(ctx, primary, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, "INSERT INTO users (email) VALUES ($1) RETURNING id", "ada@example.com").Scan(&id)
	})
	if err != nil {
		log.Fatal(err)
	}
	task := caughtupasynq.NewTask(ctx, "email:welcome", []byte(strconv.FormatInt(id, 10)))
	if _, err := client.EnqueueContext(ctx, task); err != nil {
		log.Fatal(err)
	}
}
