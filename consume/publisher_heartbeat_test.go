package consume

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

func TestPublishDue(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1_700_000_000, 0)
	inc := t0.Add(-time.Hour)
	replica := feed.Observation{Database: "main", Node: "r1", Role: feed.RoleReplica, PolledAt: t0,
		Replica: feed.ReplicaStatus{InRecovery: true, Replayed: 100, Epoch: position.Epoch{SystemID: 7, Timeline: 1},
			ReplayTimestamp: t0.Add(-time.Second), TimeLag: time.Second, Incarnation: inc, RecoveryStart: inc.Add(time.Second)}}
	primary := feed.Observation{Database: "main", Role: feed.RolePrimary, PolledAt: t0,
		Primary: feed.PrimaryStatus{Epoch: position.Epoch{SystemID: 7, Timeline: 2}, InsertLSN: 200, HistoryKnown: true,
			History: position.History{{Timeline: 1, Switchpoint: 50}}}}
	const hb = 100 * time.Millisecond
	sent := func(o feed.Observation) sentObservation { return sentObservation{obs: o, at: t0} }
	with := func(o feed.Observation, f func(*feed.Observation)) feed.Observation {
		o.Primary.History = append(position.History(nil), o.Primary.History...)
		f(&o)
		return o
	}
	for _, tc := range []struct {
		name      string
		prev      feed.Observation
		nothing   bool // nothing sent yet
		o         feed.Observation
		after     time.Duration
		heartbeat time.Duration
		due       bool
	}{
		{name: "first observation of the node", nothing: true, o: replica, due: true},
		{name: "unchanged before the heartbeat", prev: replica, o: replica, after: hb - time.Millisecond},
		{name: "unchanged at the heartbeat", prev: replica, o: replica, after: hb, due: true},
		{name: "negative heartbeat: every poll", prev: replica, o: replica, heartbeat: -1, due: true},
		{name: "only poll time, replay timestamp and time lag moved", prev: replica, o: with(replica, func(o *feed.Observation) {
			o.PolledAt = o.PolledAt.Add(10 * time.Millisecond)
			o.Replica.TimeLag += 10 * time.Millisecond
			o.Replica.ReplayTimestamp = o.Replica.ReplayTimestamp.Add(time.Millisecond)
		}), after: time.Millisecond},
		{name: "replay moved", prev: replica, o: with(replica, func(o *feed.Observation) { o.Replica.Replayed++ }), due: true},
		{name: "timeline moved", prev: replica, o: with(replica, func(o *feed.Observation) { o.Replica.Epoch.Timeline = 2 }), due: true},
		{name: "left recovery", prev: replica, o: with(replica, func(o *feed.Observation) { o.Replica.InRecovery = false }), due: true},
		{name: "restarted", prev: replica, o: with(replica, func(o *feed.Observation) { o.Replica.Incarnation = t0 }), due: true},
		{name: "replay restarted", prev: replica, o: with(replica, func(o *feed.Observation) { o.Replica.RecoveryStart = t0 }), due: true},
		{name: "poll failed", prev: replica, o: feed.Observation{Database: "main", Node: "r1", Role: feed.RoleReplica, Err: "timeout"}, due: true},
		{name: "same failure again", prev: feed.Observation{Role: feed.RoleReplica, Err: "timeout"},
			o: feed.Observation{Role: feed.RoleReplica, Err: "timeout"}, after: time.Millisecond},
		{name: "another failure", prev: feed.Observation{Role: feed.RoleReplica, Err: "timeout"},
			o: feed.Observation{Role: feed.RoleReplica, Err: "refused"}, due: true},
		{name: "primary unchanged", prev: primary, o: with(primary, func(o *feed.Observation) { o.PolledAt = o.PolledAt.Add(time.Second) }), after: time.Millisecond},
		{name: "primary inserted", prev: primary, o: with(primary, func(o *feed.Observation) { o.Primary.InsertLSN++ }), due: true},
		{name: "primary promoted", prev: primary, o: with(primary, func(o *feed.Observation) { o.Primary.Epoch.Timeline = 3 }), due: true},
		{name: "primary history learned", prev: with(primary, func(o *feed.Observation) { o.Primary.History, o.Primary.HistoryKnown = nil, false }),
			o: primary, due: true},
		{name: "primary history grew", prev: primary, o: with(primary, func(o *feed.Observation) {
			o.Primary.History = append(o.Primary.History, position.TimelineSwitch{Timeline: 2, Switchpoint: 150})
		}), due: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hb := hb
			if tc.heartbeat != 0 {
				hb = tc.heartbeat
			}
			require.Equal(t, tc.due, publishDue(sent(tc.prev), !tc.nothing, &tc.o, t0.Add(tc.after), hb))
		})
	}
}

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
	f := newFleetEnv(t, c, "")

	type key struct{ pub, node string }
	var mu sync.Mutex
	got := map[key][]feed.Observation{}
	sub, err := feed.NewSubscriber(feed.SubscriberConfig{Client: f.rdb, Feed: f.name, Keys: f.keys, Logger: testLogger(t),
		OnObservation: func(d feed.Delivery) {
			if d.Stored {
				return
			}
			mu.Lock()
			k := key{d.Publisher.Name, d.Role.String() + ":" + d.Node}
			got[k] = append(got[k], d.Observation)
			mu.Unlock()
		}})
	require.NoError(t, err)
	subCtx, stopSub := context.WithCancel(context.Background())
	subDone := make(chan struct{})
	go func() { _ = sub.Run(subCtx); close(subDone) }()
	t.Cleanup(func() { stopSub(); <-subDone })
	require.Eventually(t, func() bool { return sub.Health().State == feed.StateSubscribed }, feedDeadline, time.Millisecond)

	slow := f.publisher(t, "slow", func(c *PublisherConfig) { c.Heartbeat, c.MeterProvider = time.Hour, f.mp })
	f.publisher(t, "fast", func(c *PublisherConfig) { c.Heartbeat = 30 * time.Millisecond })
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
			require.False(t, sameFeedState(&d[i-1], &d[i]), "%s: the slow publisher sent an unchanged observation again: %+v", n, d[i])
		}
	}
	require.Less(t, sent, 50, "the slow publisher sent %d observations in 100 polls of an idle cluster", sent)
	require.Positive(t, f.metric(t, "caughtup.consume.publisher.unchanged"))

	// The fast one repeats an unchanged node every heartbeat.
	require.Eventually(t, func() bool {
		for _, n := range nodes {
			d := deliveries("fast", n)
			for i := 2; i < len(d); i++ {
				if sameFeedState(&d[i-2], &d[i-1]) && sameFeedState(&d[i-1], &d[i]) {
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
