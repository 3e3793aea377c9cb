package replay_test

import (
	"context"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
)

// A fleet of worker processes takes replica positions from a feed that a
// few publishers fill, and shares one primary fallback budget. Publishers
// and routers name the database and its replicas alike.
func ExampleFeedConfig() {
	ctx := context.Background()
	primary, err := pgxpool.New(ctx, "postgres://app@primary/app")
	if err != nil {
		log.Fatal(err)
	}
	r1, err := pgxpool.New(ctx, "postgres://app@replica-1/app")
	if err != nil {
		log.Fatal(err)
	}
	dbs := map[string]replay.Database{"main": {Primary: primary, Replicas: []replay.Replica{{Name: "r1", Pool: r1}}}}
	keys, err := feed.ParseKeys(os.Getenv("CAUGHTUP_FEED_KEYS")) // "k1:base64secret"; `caughtup feed --generate-key k1`
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"redis:6379"}})
	ring := feed.Keyring{Keys: keys}

	// In two or three processes (or `caughtup feed`): poll and publish.
	snd, err := feed.NewSender(feed.SenderConfig{Client: rdb, Keys: ring})
	if err != nil {
		log.Fatal(err)
	}
	pub, err := replay.NewPublisher(ctx, dbs, replay.PublisherConfig{Feed: snd}) // pub.Close closes snd
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()

	// In every worker process: route from the feed, under the fleet budget.
	src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: rdb, Keys: ring})
	if err != nil {
		log.Fatal(err)
	}
	budget, err := feed.NewBudget(feed.BudgetConfig{Client: rdb, Rate: 200, Burst: 200})
	if err != nil {
		log.Fatal(err)
	}
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:   dbs,
		FleetBudget: budget,
		Tracker:     replay.TrackerConfig{Feed: &replay.FeedConfig{Source: src}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	log.Printf("on the feed: %v", router.Tracker().Feed().Active)
}
