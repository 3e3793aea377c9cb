package replay_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/replay"
)

// A replay.Guard is installed on the replica pool's config before the pool
// is built, then given to the Router with that replica. New connections of
// the pool then wait until the replica has replayed what the tracker saw
// it replay, so that a replica restarted between a job's routing and its
// read never serves that read stale.
func ExampleGuard() {
	ctx := context.Background()
	primary, err := pgxpool.New(ctx, "postgres://app@primary/app")
	if err != nil {
		log.Fatal(err)
	}
	guard, err := replay.NewGuard(replay.GuardConfig{}) // defaults: hold up to 2s
	if err != nil {
		log.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig("postgres://app@replica-1/app")
	if err != nil {
		log.Fatal(err)
	}
	guard.Install(cfg) // after any AfterConnect of your own
	replica, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {
			Primary:  primary,
			Replicas: []replay.Replica{{Name: "replica-1", Pool: replica, Guard: guard}},
		}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
}
