package consume

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/redistest"
)

// TestFeedRedisSentinelFailover: routers and publishers reach Redis
// through three sentinels (quorum 2); the master is killed mid-run and a
// replica promoted (runRedisFailover, feed_redis_cluster_test.go).
func TestFeedRedisSentinelFailover(t *testing.T) {
	t.Parallel()
	rs, err := redistest.StartSentinel(ctxT(t), redistest.SentinelOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, rs.Close()) })
	runRedisFailover(t, redisDeployment{
		kind: "sentinel",
		options: func() *redis.UniversalOptions {
			return &redis.UniversalOptions{MasterName: rs.MasterName(), Addrs: rs.SentinelAddrs()}
		},
		budgetPrefix: func(feedName string) string { return "caughtup.budget." + feedName + "." },
		killMaster: func(ctx context.Context, _ string) (string, error) {
			m, err := rs.Master(ctx)
			if err != nil {
				return "", err
			}
			return m.Name(), m.Kill()
		},
		recovered: rs.WaitSettled,
	})
}
