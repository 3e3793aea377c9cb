package caughtupasynq_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"maps"
	"slices"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
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
	// caughtupasynq.NewTask, not asynq.NewTask: it keeps the options where
	// the client can find them. Options work as with asynq alone, here or
	// at the enqueue.
	task := caughtupasynq.NewTask(ctx, "email:welcome", []byte(`{"email":"ada@example.com"}`), asynq.MaxRetry(5))
	if _, err := client.EnqueueContext(ctx, task, asynq.Queue("mail")); err != nil {
		log.Fatal(err)
	}
}

// printer stands in for *asynq.Client: it prints what would be enqueued.
type printer struct{}

func (printer) EnqueueContext(_ context.Context, task *asynq.Task, _ ...asynq.Option) (*asynq.TaskInfo, error) {
	for _, k := range slices.Sorted(maps.Keys(task.Headers())) {
		fmt.Printf("%s: %s\n", k, task.Headers()[k])
	}
	return &asynq.TaskInfo{}, nil
}

// A task carries the token of the context it was enqueued with, merged
// with what it already had, and the absolute deadline of its options.
func ExampleNewTask() {
	tok := position.New("main", position.Epoch{SystemID: 7451283476502304825, Timeline: 1}, 0x16B3740,
		position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
	ctx := enqueue.WithToken(context.Background(), tok)

	client := caughtupasynq.NewClient(printer{})
	task := caughtupasynq.NewTask(ctx, "email:welcome", nil, asynq.Deadline(time.Unix(1_800_000_000, 0)))
	if _, err := client.EnqueueContext(ctx, task, asynq.Queue("mail")); err != nil {
		fmt.Println(err)
	}
	// Output:
	// caughtup-deadline: 1800000000
	// caughtup-dedup: 0
	// caughtup-token: v1;loyw3v28;main=p.676846d7e1a85839.1.0/16B3740
}

// asynq cannot give back the options of a task built by asynq.NewTask, so
// the client refuses to stamp one rather than lose them or send it
// unstamped.
func ExampleClient_EnqueueContext_foreignTask() {
	tok := position.New("main", position.Epoch{SystemID: 7451283476502304825, Timeline: 1}, 0x16B3740,
		position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
	ctx := enqueue.WithToken(context.Background(), tok)

	client := caughtupasynq.NewClient(printer{})
	_, err := client.EnqueueContext(ctx, asynq.NewTask("email:welcome", nil, asynq.MaxRetry(5)))
	fmt.Println(errors.Is(err, caughtupasynq.ErrForeignTask))
	// Output:
	// true
}

// The worker builds one router from the pools it has and one server that
// routes every task before its handler runs; handlers read from the pool
// the middleware chose.
func ExampleNewServer() {
	ctx := context.Background()
	primary, _ := pgxpool.New(ctx, "postgres://app@primary/app")
	replica1, _ := pgxpool.New(ctx, "postgres://app@replica1/app")
	replica2, _ := pgxpool.New(ctx, "postgres://app@replica2/app")

	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{
			"main": {Primary: primary, Replicas: replay.Replicas(replica1, replica2)},
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	srv, err := caughtupasynq.NewServer(asynq.RedisClientOpt{Addr: "localhost:6379"},
		asynq.Config{Concurrency: 20, Queues: map[string]int{"mail": 1}},
		router, caughtupasynq.MiddlewareConfig{
			// GitLab's data consistency, per task type.
			Policies: map[string]consume.Policy{
				"email:":   consume.Delayed, // wait for a replica, defer, then the primary
				"search:":  consume.Sticky,  // a caught-up replica, else the primary at once
				"billing:": consume.Always,  // the primary
			},
		})
	if err != nil {
		log.Fatal(err)
	}
	mux := asynq.NewServeMux()
	mux.HandleFunc("email:welcome", func(ctx context.Context, t *asynq.Task) error {
		var id int64
		return consume.DB(ctx, "main").QueryRow(ctx, "SELECT id FROM users WHERE email = $1", "ada@example.com").Scan(&id)
	})
	if err := srv.Run(mux); err != nil {
		log.Fatal(err)
	}
}

// The pieces NewServer wires, for a server built another way: the hooks on
// the asynq.Config and the middleware on the mux. Both are needed; the
// middleware reports deferrals that come back without the hooks.
func ExampleServerConfig() {
	ctx := context.Background()
	primary, _ := pgxpool.New(ctx, "postgres://app@primary/app")
	replica, _ := pgxpool.New(ctx, "postgres://app@replica1/app")
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replica)}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	redisOpt := asynq.RedisClientOpt{Addr: "localhost:6379"}
	srv := asynq.NewServer(redisOpt, caughtupasynq.ServerConfig(asynq.Config{Concurrency: 20}))
	mux := asynq.NewServeMux()
	mux.Use(caughtupasynq.Middleware(router, caughtupasynq.MiddlewareConfig{Redis: redisOpt}))
	mux.HandleFunc("email:welcome", func(ctx context.Context, t *asynq.Task) error { return nil })
	if err := srv.Run(mux); err != nil {
		log.Fatal(err)
	}
}
