package feed

import (
	"context"
	"errors"
	"strings"

	"github.com/redis/go-redis/v9"
)

// Pub/sub in a Redis Cluster: classic PUBLISH is broadcast over the
// cluster bus to every node, so each message costs every node of the
// cluster, whereas a sharded SPUBLISH (Redis 7.0) goes only to the
// master and replicas of the channel's slot. The feed's channel and keys
// share one hash tag, so the slot that stores the values also carries the
// messages, and a failover moves both together. On a *redis.ClusterClient
// (what redis.NewUniversalClient returns for several Addrs, and
// NewClusterClient) publishers SPUBLISH and subscribers SSUBSCRIBE; on
// every other client (one server, a Sentinel failover client, a ring)
// they use classic pub/sub. Both sides decide from their own client, so a
// fleet on one Cluster agrees without configuration; a Cluster whose
// servers do not know the sharded commands (before 7.0) is detected by
// the "unknown command" reply, and both sides then use classic pub/sub.
//
// go-redis's ClusterClient reloads its slot map on MOVED replies and
// every 10s; after a master dies its client keeps sending that slot's
// commands to the dead address until then. The feed and the budget ask
// it to reload (ReloadState, asynchronous and deduplicated) after every
// failure, so that they find the promoted replica within a reload of the
// failover rather than up to 10s later.

// shardedClient reports whether c is a Redis Cluster client.
func shardedClient(c redis.UniversalClient) bool {
	_, ok := c.(*redis.ClusterClient)
	return ok
}

// reloadSlots asks a Cluster client to reload its slot map after a
// failure; other clients need nothing.
func reloadSlots(ctx context.Context, c redis.UniversalClient) {
	if cc, ok := c.(*redis.ClusterClient); ok {
		cc.ReloadState(ctx)
	}
}

// unknownCommand reports whether err is a server's reply that it does
// not know a command: sharded pub/sub on Redis before 7.0.
func unknownCommand(err error) bool {
	var re redis.Error
	return err != nil && errors.As(err, &re) && strings.Contains(strings.ToLower(re.Error()), "unknown command")
}
