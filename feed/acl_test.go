package feed_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
)

// setUser runs ACL SETUSER name on >password <rules> as the default user.
func setUser(t *testing.T, admin *redis.Client, name, password, rules string) {
	t.Helper()
	args := []any{"ACL", "SETUSER", name, "on", ">" + password}
	for _, r := range strings.Fields(rules) {
		args = append(args, r)
	}
	require.NoError(t, admin.Do(context.Background(), args...).Err(), "ACL SETUSER %s %s", name, rules)
	t.Cleanup(func() { _ = admin.Do(context.Background(), "ACL", "DELUSER", name).Err() })
}

func requireNoPerm(t *testing.T, err error, what string) {
	t.Helper()
	require.Error(t, err, what)
	require.Contains(t, err.Error(), "NOPERM", what)
}

// TestACL: a publisher user and a router user with exactly the documented
// rules run the feed and the budget; neither can do the other's job, and
// the router cannot write the feed.
func TestACL(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	admin := client(t, nil)
	name, k := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k}}
	pubUser, subUser := "pub-"+name, "sub-"+name
	setUser(t, admin, pubUser, "pub-secret", feed.PublisherACL(name))
	setUser(t, admin, subUser, "sub-secret", feed.SubscriberACL(name)+" "+feed.BudgetACL(""))
	asPub := client(t, &redis.Options{Username: pubUser, Password: "pub-secret"})
	asSub := client(t, &redis.Options{Username: subUser, Password: "sub-secret"})

	s := startSubscriber(t, feed.SubscriberConfig{Client: asSub, Feed: name, Keys: ring})
	s.waitState(t, feed.StateSubscribed)
	p, _ := startPublisher(t, feed.SenderConfig{Client: asPub, Feed: name, Name: "a", Keys: ring})
	publish(t, p, replica("r1", 7))
	require.Equal(t, position.LSN(7), s.next(t).Replica.Replayed)
	late := startSubscriber(t, feed.SubscriberConfig{Client: asSub, Feed: name, Keys: ring})
	d := late.next(t)
	require.True(t, d.Stored, "the router user reads the stored values with MULTI/GET/PTTL")

	b, err := feed.NewBudget(feed.BudgetConfig{Client: asSub, Rate: 10})
	require.NoError(t, err)
	ok, err := b.Allow(ctx, "main")
	require.NoError(t, err, "the router user runs the budget's script")
	require.True(t, ok)

	// The router user cannot write the feed, nor anything else.
	feedKey := feed.ValueKeyForTest(name, "a", &feed.Observation{Database: "main", Node: "r1", Role: feed.RoleReplica})
	requireNoPerm(t, asSub.Set(ctx, feedKey, "forged", 0).Err(), "router SET feed key")
	requireNoPerm(t, asSub.Del(ctx, feedKey).Err(), "router DEL feed key")
	requireNoPerm(t, asSub.SAdd(ctx, feed.IndexKeyForTest(name), "x").Err(), "router SADD index")
	requireNoPerm(t, asSub.Publish(ctx, feed.ChannelName(name), "forged").Err(), "router PUBLISH")
	requireNoPerm(t, asSub.Set(ctx, "unrelated", "x", 0).Err(), "router SET elsewhere")
	requireNoPerm(t, asSub.Get(ctx, "rate:unrelated").Err(), "router outside the budget prefix")
	router, err := feed.NewSender(feed.SenderConfig{Client: asSub, Feed: name, Name: "posing", Keys: ring, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, router.Publish(replica("r1", 8)))
	requireNoPerm(t, router.Flush(ctx), "a router posing as a publisher")
	require.NoError(t, router.Close())

	// The publisher user cannot read, subscribe, or touch other keys or
	// channels.
	requireNoPerm(t, asPub.Get(ctx, feedKey).Err(), "publisher GET")
	requireNoPerm(t, asPub.SMembers(ctx, feed.IndexKeyForTest(name)).Err(), "publisher SMEMBERS")
	requireNoPerm(t, asPub.Set(ctx, "unrelated", "x", 0).Err(), "publisher SET elsewhere")
	requireNoPerm(t, asPub.Publish(ctx, "other-channel", "x").Err(), "publisher PUBLISH elsewhere")
	requireNoPerm(t, asPub.Do(ctx, "FLUSHALL").Err(), "publisher FLUSHALL")
	ps := asPub.Subscribe(ctx, feed.ChannelName(name))
	_, err = ps.Receive(ctx)
	_ = ps.Close()
	requireNoPerm(t, err, "publisher SUBSCRIBE")

	// Nothing was rejected: the forgeries never reached the channel.
	s.none(t)
	require.Zero(t, s.metrics.sum(t, "caughtup.feed.rejected"))
}
