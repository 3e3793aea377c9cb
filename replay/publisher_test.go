package replay_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// TestPublisherHeartbeat: on an idle cluster of its own, a publisher
// whose heartbeat never comes due publishes each node once and then only
// its changes (a write moves the primary, then the replica), while one
// with a short heartbeat repeats an unchanged node.
func TestPublisherHeartbeat(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	f := newFleet(t, c, "")

	type key struct{ pub, node string }
	var mu sync.Mutex
	got := map[key][]feed.Observation{}
	sub, err := feed.NewSubscriber(feed.SubscriberConfig{Client: f.rdb, Feed: f.name, Keys: f.keys, Logger: logger(t),
		OnObservation: func(d feed.Delivery) {
			if d.Stored {
				return
			}
			mu.Lock()
			k := key{d.Publisher.Name, d.Role.String() + ":" + d.Node}
			got[k] = append(got[k], d.FeedObservation)
			mu.Unlock()
		}})
	require.NoError(t, err)
	subCtx, stopSub := context.WithCancel(context.Background())
	subDone := make(chan struct{})
	go func() { _ = sub.Run(subCtx); close(subDone) }()
	t.Cleanup(func() { stopSub(); <-subDone })
	require.Eventually(t, func() bool { return sub.Health().State == feed.StateSubscribed }, feedDeadline, time.Millisecond)

	slow := f.publisher(t, "slow", func(_ *feed.SenderConfig, c *replay.PublisherConfig) { c.Heartbeat, c.MeterProvider = time.Hour, f.mp })
	f.publisher(t, "fast", func(_ *feed.SenderConfig, c *replay.PublisherConfig) { c.Heartbeat = 30 * time.Millisecond })
	nodes := []string{"primary:", "replica:r1"}
	deliveries := func(pub, node string) []feed.Observation {
		mu.Lock()
		defer mu.Unlock()
		return append([]feed.Observation(nil), got[key{pub, node}]...)
	}
	require.Eventually(t, func() bool {
		return len(deliveries("slow", nodes[0])) > 0 && len(deliveries("slow", nodes[1])) > 0
	}, feedDeadline, time.Millisecond, "the slow publisher's first observations")

	// A hundred more polls of the slow publisher.
	s := slow.Snapshot()
	for seq0 := s.Seq; s.Seq < seq0+100; s = slow.Snapshot() {
		select {
		case <-s.Changed():
		case <-ctx.Done():
			t.Fatal("the publisher stopped polling")
		}
	}
	sent := 0
	for _, n := range nodes {
		d := deliveries("slow", n)
		sent += len(d)
		for i := 1; i < len(d); i++ {
			require.False(t, d[i-1].SameState(&d[i]), "%s: the slow publisher sent an unchanged observation again: %+v", n, d[i])
		}
	}
	require.Less(t, sent, 50, "the slow publisher sent %d observations in 100 polls of an idle cluster", sent)
	require.Positive(t, f.metric(t, "caughtup.consume.publisher.unchanged"))

	// The fast one repeats an unchanged node every heartbeat.
	require.Eventually(t, func() bool {
		for _, n := range nodes {
			d := deliveries("fast", n)
			for i := 2; i < len(d); i++ {
				if d[i-2].SameState(&d[i-1]) && d[i-1].SameState(&d[i]) {
					return true
				}
			}
		}
		return false
	}, feedDeadline, time.Millisecond, "the fast publisher's heartbeats")

	// A change goes out whatever the heartbeat: the write's insert
	// position, then the replica replaying it.
	_, tok := f.write(t)
	lsn := tok.Entries[0].LSN
	require.Eventually(t, func() bool {
		var primary, replica bool
		for _, o := range deliveries("slow", nodes[0]) {
			primary = primary || o.Primary.InsertLSN >= lsn
		}
		for _, o := range deliveries("slow", nodes[1]) {
			replica = replica || o.Replica.Replayed >= lsn
		}
		return primary && replica
	}, feedDeadline, time.Millisecond, "the slow publisher's observations of the write")
}
