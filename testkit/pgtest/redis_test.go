package pgtest_test

import (
	"context"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

func TestRedisStopKillStart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := pgtest.StartRedis(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, r.Close()) })

	pids := testsvc.ProcessesIn([]string{r.Dir()})
	require.Len(t, pids, 1)
	fi, err := os.Stat("/proc/" + strconv.Itoa(pids[0]))
	require.NoError(t, err)
	// Even as root, unlike PostgreSQL: tests CONFIG SET it to their own
	// files (feed's TestTLS, certificates in a 0700 t.TempDir).
	require.Equal(t, uint32(os.Geteuid()), fi.Sys().(*syscall.Stat_t).Uid, "redis-server runs as the test binary")

	client := redis.NewClient(&redis.Options{Addr: r.Addr(), MaxRetries: -1, DialTimeout: time.Second})
	defer func() { require.NoError(t, client.Close()) }()
	require.NoError(t, client.Ping(ctx).Err())
	require.NoError(t, client.Set(ctx, "k", "v", 0).Err())

	addr := r.Addr()
	for name, stop := range map[string]func() error{"Stop": r.Stop, "Kill": r.Kill} {
		require.NoError(t, stop(), name)
		require.False(t, r.Running())
		require.Error(t, client.Ping(ctx).Err(), "PING after %s", name)
		require.NoError(t, r.Start(ctx), name)
		require.Equal(t, addr, r.Addr(), "restart keeps the port")
		require.NoError(t, client.Ping(ctx).Err(), "PING after %s/Start", name)
	}
	require.Equal(t, redis.Nil, client.Get(ctx, "k").Err(), "persistence is off")

	require.NoError(t, r.Close())
	require.NoError(t, r.Close(), "Close is idempotent")
	require.False(t, r.Running())
	require.Error(t, r.Start(ctx), "a closed Redis does not start again")
	require.NoDirExists(t, r.Dir())
}

func TestSharedRedis(t *testing.T) {
	r := pgtest.SharedRedis(t)
	require.Same(t, r, pgtest.SharedRedis(t))
	client := redis.NewClient(&redis.Options{Addr: r.Addr()})
	defer func() { require.NoError(t, client.Close()) }()
	require.NoError(t, client.Ping(context.Background()).Err())
}
