package feed_test

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/redistest"
)

// TestSentinelFailover: through a Sentinel failover client the feed uses
// classic pub/sub on the master; when the master is SIGKILLed the
// subscriber drops, resubscribes to the replica the sentinels promote and
// hears the publisher again.
func TestSentinelFailover(t *testing.T) {
	t.Parallel()
	t.Cleanup(waitDialersGone) // after the clients close
	rs, err := redistest.StartSentinel(testContext(t), redistest.SentinelOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, rs.Close()) })
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{MasterName: rs.MasterName(), Addrs: rs.SentinelAddrs(),
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { _ = rdb.Close() })
	_, cluster := rdb.(*redis.ClusterClient)
	require.False(t, cluster)

	name, k := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k}}
	s := startSubscriber(t, feed.SubscriberConfig{Client: rdb, Feed: name, Keys: ring})
	s.waitState(t, feed.StateSubscribed)
	p, _ := startPublisher(t, feed.SenderConfig{Client: rdb, Feed: name, Name: "a", Keys: ring})
	publish(t, p, replica("r1", 7))
	require.Equal(t, position.LSN(7), s.next(t).Replica.Replayed)

	ctx := testContext(t)
	m, err := rs.Master(ctx)
	require.NoError(t, err)
	ch := feed.ChannelName(name)
	mc := nodeClient(t, m)
	require.Equal(t, map[string]int64{ch: 1}, mc.PubSubNumSub(ctx, ch).Val(), "a classic subscriber on the master")

	killed := time.Now()
	require.NoError(t, m.Kill())
	states := s.waitState(t, feed.StateSubscribed)
	resubscribed := time.Since(killed)
	require.Contains(t, states, feed.StateDropped, "the subscription broke with its master")
	d := publishUntil(t, p, s, 100)
	heard := time.Since(killed)
	require.NoError(t, rs.WaitSettled(ctx))
	nu, err := rs.Master(ctx)
	require.NoError(t, err)
	require.NotSame(t, m, nu)
	require.Equal(t, map[string]int64{ch: 1}, nodeClient(t, nu).PubSubNumSub(ctx, ch).Val(), "resubscribed on the promoted replica")
	t.Logf("master killed: subscriber went %v and was subscribed again %v later; first live delivery at %d after %v; %s is master",
		states, resubscribed, d.Replica.Replayed, heard, nu.Name())
}
