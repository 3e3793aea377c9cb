package caughtupriver_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/river/caughtupriver"
)

type WelcomeArgs struct {
	UserID int64 `json:"user_id"`
}

func (WelcomeArgs) Kind() string { return "email_welcome" }

// WelcomeWorker reads the user on a replica that has the job's writes.
type WelcomeWorker struct {
	river.WorkerDefaults[WelcomeArgs]
}

func (w *WelcomeWorker) Work(ctx context.Context, job *river.Job[WelcomeArgs]) error {
	var email string
	return consume.DB(ctx, "main").QueryRow(ctx, "SELECT email FROM users WHERE id = $1", job.Args.UserID).Scan(&email)
}

// A River client whose workers run on caught-up replicas, and a job
// inserted after its commit, which carries the commit's token. It needs a
// primary with streaming replicas, so it is compiled, not run.
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
	mw, err := caughtupriver.NewMiddleware(router, caughtupriver.Config{
		Policies: map[string]consume.Policy{"email_welcome": consume.Delayed},
	})
	if err != nil {
		log.Fatal(err)
	}
	workers := river.NewWorkers()
	if err := river.AddWorkerSafely(workers, &WelcomeWorker{}); err != nil {
		log.Fatal(err)
	}
	client, err := river.NewClient(riverpgxv5.New(primary), &river.Config{
		Queues:     map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 20}},
		Workers:    workers,
		Middleware: []rivertype.Middleware{mw},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := client.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer func() {
		if err := client.Stop(ctx); err != nil {
			log.Print(err)
		}
	}()

	// Insert after the commit: the job carries the commit's token. (A job
	// inserted with client.InsertTx in the same transaction needs none: it
	// is routed by the primary's position read after its fetch.)
	var id int64
	ctx, err = enqueue.InTx(ctx, primary, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, "INSERT INTO users (email) VALUES ($1) RETURNING id", "ada@example.com").Scan(&id)
	})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := caughtupriver.Insert(ctx, client, WelcomeArgs{UserID: id}, nil); err != nil {
		log.Fatal(err)
	}
}
