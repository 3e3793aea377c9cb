package asynq_test

import (
	"context"
	"log"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	caughtupasynq "github.com/caughtup/caughtup/asynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
)

// The producer commits, then enqueues with the context the commit
// returned; the client stamps the task with the commit's position.
func ExampleClient() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@primary/app")
	if err != nil {
		log.Fatal(err)
	}
	client := caughtupasynq.NewClient(asynq.NewClient(asynq.RedisClientOpt{Addr: "localhost:6379"}))

	ctx, err = enqueue.InTx(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO users (email) VALUES ($1)", "ada@example.com")
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	// Options work as with asynq alone, on NewTask or here.
	task := asynq.NewTask("email:welcome", []byte(`{"email":"ada@example.com"}`), asynq.MaxRetry(5))
	if _, err := client.EnqueueContext(ctx, task, asynq.Queue("mail")); err != nil {
		log.Fatal(err)
	}
}

// The worker builds one router from the pools it has, puts the hooks on
// the server and the middleware on the mux; handlers read from the pool
// the middleware chose.
func ExampleMiddleware() {
	ctx := context.Background()
	primary, _ := pgxpool.New(ctx, "postgres://app@primary/app")
	replica1, _ := pgxpool.New(ctx, "postgres://app@replica1/app")
	replica2, _ := pgxpool.New(ctx, "postgres://app@replica2/app")

	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]consume.Database{
			"main": {Primary: primary, Replicas: consume.Replicas(replica1, replica2)},
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	srv := asynq.NewServer(asynq.RedisClientOpt{Addr: "localhost:6379"},
		caughtupasynq.ServerConfig(asynq.Config{Concurrency: 20, Queues: map[string]int{"mail": 1}}))
	mux := asynq.NewServeMux()
	mux.Use(caughtupasynq.Middleware(router, caughtupasynq.MiddlewareConfig{
		// GitLab's data consistency, per task type.
		Policies: map[string]consume.Policy{
			"email:":   consume.Delayed, // wait for a replica, defer, then the primary
			"search:":  consume.Sticky,  // a caught-up replica, else the primary at once
			"billing:": consume.Always,  // the primary
		},
	}))
	mux.HandleFunc("email:welcome", func(ctx context.Context, t *asynq.Task) error {
		var id int64
		err := consume.DB(ctx, "main").QueryRow(ctx, "SELECT id FROM users WHERE email = $1", "ada@example.com").Scan(&id)
		return err
	})
	if err := srv.Run(mux); err != nil {
		log.Fatal(err)
	}
}
