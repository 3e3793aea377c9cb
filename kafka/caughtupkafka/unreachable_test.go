package caughtupkafka_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// TestUnreachableReplicaOnTheFeed: the feed's publishers reach r1 and call
// it healthy, but this process's pool to r1 goes through a proxy that
// starts refusing, and r2 is paused. The router leaves r1 out of its
// decisions after the first failed acquire, so the messages wait for r2,
// are deferred or read the primary: none is dead-lettered, none reads
// stale, none is lost.
func TestUnreachableReplicaOnTheFeed(t *testing.T) {
	e := setupDB(t, nil)
	ctx := t.Context()
	r1, r2 := e.Cluster.Replicas()[0], e.Cluster.Replicas()[1]
	proxy, err := fault.NewProxy(fmt.Sprintf("127.0.0.1:%d", r1.Port()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	viaProxy, err := pgxpool.New(ctx, fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&connect_timeout=2", proxy.Addr(), e.DB))
	require.NoError(t, err)
	t.Cleanup(viaProxy.Close)

	rdb := redis.NewClient(&redis.Options{Addr: pgtest.SharedRedis(t).Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	key, err := feed.GenerateKey("k1")
	require.NoError(t, err)
	keys := feed.Keyring{Keys: []feed.Key{key}}
	name := fmt.Sprintf("unreachable-%d", time.Now().UnixNano())
	direct := map[string]replay.Database{"main": {Primary: e.Primary, Replicas: []replay.Replica{{Name: "r1", Pool: e.Replicas[0]}, {Name: "r2", Pool: e.Replicas[1]}}}}
	for _, pn := range []string{"pub-a", "pub-b"} {
		snd, err := feed.NewSender(feed.SenderConfig{Client: rdb, Feed: name, Name: pn, Keys: keys})
		require.NoError(t, err)
		p, err := replay.NewPublisher(ctx, direct, replay.PublisherConfig{Feed: snd})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
	}
	src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: rdb, Feed: name, Keys: keys, MeterProvider: e.MP})
	require.NoError(t, err)
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases:     map[string]replay.Database{"main": {Primary: e.Primary, Replicas: []replay.Replica{{Name: "r1", Pool: viaProxy}, {Name: "r2", Pool: e.Replicas[1]}}}},
		Tracker:       replay.TrackerConfig{Feed: &replay.FeedConfig{Source: src}},
		MeterProvider: e.MP, WaitBudget: 200 * time.Millisecond, DeferInitial: 50 * time.Millisecond, DeferMax: 250 * time.Millisecond,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = router.Close() })
	require.Eventually(t, func() bool { return router.Tracker().Feed().Active }, 30*time.Second, 10*time.Millisecond, "the router is on the feed")

	require.NoError(t, r2.PauseReplay(ctx))
	t.Cleanup(func() { _ = r2.ResumeReplay(context.Background()) })
	proxy.Refuse()
	proxy.Cut() // connections made before the refusal die too

	topic := kafkasuite.NewTopics(t, 1, "")[0]
	l := kafkasuite.NewLedger()
	startConsumer(t, caughtupkafka.ConsumerConfig{Topic: topic, Router: router, Policy: consume.Delayed, MeterProvider: e.MP}, ledgerHandler(l))
	w := caughtupkafka.NewWriter(newWriter(t, topic))
	const n = 40
	for i := range int64(n) {
		mctx, err := e.Insert(ctx, i+1, "k", int(i))
		require.NoError(t, err)
		require.NoError(t, w.WriteMessages(mctx, kafka.Message{Key: []byte("k"), Value: kafkasuite.Payload(i+1, "k", int(i))}))
	}
	// Feed says r1 is fine throughout; r2 catches up only now.
	time.Sleep(2 * time.Second)
	require.NoError(t, r2.ResumeReplay(ctx))
	l.WaitDistinct(t, n, time.Minute)
	stale, lost, violations, _ := l.Summary(n)
	require.Eventually(t, func() bool { return e.Results(t)["handled"] >= n }, 30*time.Second, 50*time.Millisecond, "the consumer counts what it committed")
	results := e.Results(t)
	t.Logf("%d messages: results %v, outcomes %v, feed %+v", n, results, l.Outcomes(), router.Tracker().Feed())
	require.Zero(t, stale, "stale reads: %v", l.Stale())
	require.Zero(t, lost)
	require.Zero(t, violations)
	require.Zero(t, results["dead_lettered"], "a message was dead-lettered because this process cannot reach r1")
	require.Positive(t, e.Sums(t, "caughtup.consume.replica.exclusions", "caughtup.replica")["r1"], "r1 was left out after a failed acquire")
	s := router.Snapshot().Database("main").Replicas[0]
	require.ErrorIs(t, s.Err, consume.ErrUnreachable, "the router's snapshot shows r1 out of its reach")
}
