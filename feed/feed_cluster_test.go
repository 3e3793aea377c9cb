package feed_test

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/redistest"
)

func startCluster(t *testing.T, opts redistest.ClusterOptions) (*redistest.Cluster, redis.UniversalClient) {
	t.Helper()
	t.Cleanup(waitDialersGone) // after the clients close
	rc, err := redistest.StartCluster(testContext(t), opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, rc.Close()) })
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: rc.Addrs(),
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { _ = rdb.Close() })
	_, ok := rdb.(*redis.ClusterClient)
	require.True(t, ok, "several Addrs make a Cluster client")
	return rc, rdb
}

// nodeClient talks to one node of the cluster.
func nodeClient(t *testing.T, s *redistest.Server) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// publishUntil publishes replica observations of node r1 at growing
// positions until s delivers one live, through failures, and returns it.
func publishUntil(t *testing.T, p *feed.Sender, s *sub, from position.LSN) feed.Delivery {
	t.Helper()
	lsn := from
	deadlineAt := time.Now().Add(deadline)
	for time.Now().Before(deadlineAt) {
		require.NoError(t, p.Publish(replica("r1", lsn)))
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = p.Flush(ctx) // fails while the slot has no master
		cancel()
		select {
		case d := <-s.deliveries:
			if !d.Stored && d.Replica.Replayed >= from {
				return d
			}
		case <-time.After(20 * time.Millisecond):
		}
		lsn++
	}
	t.Fatalf("no live delivery at or past %d within %v; logs:\n%s", from, deadline, s.logs)
	return feed.Delivery{}
}

// TestClusterShardedPubSub: on a Cluster client the feed publishes with
// SPUBLISH and subscribes with SSUBSCRIBE on the master of its slot; when
// that master is SIGKILLed, the subscriber drops, resubscribes to the
// promoted replica and hears the publisher again.
func TestClusterShardedPubSub(t *testing.T) {
	t.Parallel()
	rc, rdb := startCluster(t, redistest.ClusterOptions{})
	name, k := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k}}
	s := startSubscriber(t, feed.SubscriberConfig{Client: rdb, Feed: name, Keys: ring})
	s.waitState(t, feed.StateSubscribed)
	p, _ := startPublisher(t, feed.SenderConfig{Client: rdb, Feed: name, Name: "a", Keys: ring})
	publish(t, p, replica("r1", 7))
	d := s.next(t)
	require.Equal(t, position.LSN(7), d.Replica.Replayed)
	require.False(t, d.Stored)

	ctx := testContext(t)
	ch := feed.ChannelName(name)
	m, err := rc.MasterOf(ctx, ch)
	require.NoError(t, err)
	mc := nodeClient(t, m)
	require.Equal(t, map[string]int64{ch: 1}, mc.PubSubShardNumSub(ctx, ch).Val(), "one sharded subscriber on the slot's master")
	require.Equal(t, map[string]int64{ch: 0}, mc.PubSubNumSub(ctx, ch).Val(), "no classic one")
	stats := mc.Info(ctx, "commandstats").Val()
	require.Contains(t, stats, "cmdstat_spublish:calls=")
	require.NotContains(t, stats, "cmdstat_publish:")

	killed := time.Now()
	require.NoError(t, m.Kill())
	states := s.waitState(t, feed.StateSubscribed)
	resubscribed := time.Since(killed)
	require.Contains(t, states, feed.StateDropped, "the subscription broke with its master")
	d = publishUntil(t, p, s, 100)
	heard := time.Since(killed)
	require.NoError(t, rc.WaitHealthy(ctx))
	nu, err := rc.MasterOf(ctx, ch)
	require.NoError(t, err)
	require.NotSame(t, m, nu)
	require.Equal(t, map[string]int64{ch: 1}, nodeClient(t, nu).PubSubShardNumSub(ctx, ch).Val(), "resubscribed on the promoted replica")
	t.Logf("master %s killed: subscriber went %v and was subscribed again %v later; first live delivery at %d after %v; %s serves the slot",
		m.Name(), states, resubscribed, d.Replica.Replayed, heard, nu.Name())
}

// TestClusterWithoutShardedPubSub: a Cluster whose servers refuse SPUBLISH
// and SSUBSCRIBE (as before Redis 7.0) gets classic pub/sub from both
// sides, which find that out alike.
func TestClusterWithoutShardedPubSub(t *testing.T) {
	t.Parallel()
	_, rdb := startCluster(t, redistest.ClusterOptions{Args: []string{
		"--rename-command", "SPUBLISH", "", "--rename-command", "SSUBSCRIBE", ""}})
	name, k := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k}}
	s := startSubscriber(t, feed.SubscriberConfig{Client: rdb, Feed: name, Keys: ring})
	s.waitState(t, feed.StateSubscribed)
	var logs logBuffer
	p, _ := startPublisher(t, feed.SenderConfig{Client: rdb, Feed: name, Name: "a", Keys: ring, Logger: logs.logger()})
	d := publishUntil(t, p, s, 7)
	require.GreaterOrEqual(t, d.Replica.Replayed, position.LSN(7))
	require.Contains(t, s.logs.String(), "does not know SSUBSCRIBE")
	require.Contains(t, logs.String(), "does not know SPUBLISH")
}

// waitDialersGone waits until no go-redis pool is retrying a dead
// address (it sleeps 1s between dials and ends on the next wake after its
// client closed), which goleak would report.
func waitDialersGone() {
	buf := make([]byte, 1<<20)
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if n := runtime.Stack(buf, true); !strings.Contains(string(buf[:n]), "pool.(*ConnPool).tryDial") {
			return
		}
	}
}
