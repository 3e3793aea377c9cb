package redistest_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/redistest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// TestClusterFailover: a SIGKILLed master's replica takes its slots, the
// data written before the kill is there, and the killed node comes back
// as a replica. Both ways of creating the cluster.
func TestClusterFailover(t *testing.T) {
	for _, noCLI := range []bool{false, true} {
		t.Run(map[bool]string{false: "redis-cli", true: "from-go"}[noCLI], func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			began := time.Now()
			c, err := redistest.StartCluster(ctx, redistest.ClusterOptions{NoRedisCLI: noCLI})
			require.NoError(t, err)
			t.Logf("cluster up in %v", time.Since(began))
			t.Cleanup(func() { require.NoError(t, c.Close()) })
			require.Len(t, c.Addrs(), 6)
			dirs := []string{}
			for _, n := range c.Nodes() {
				dirs = append(dirs, n.Dir())
			}
			requireServiceUser(t, dirs)

			rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), DialTimeout: time.Second, ReadTimeout: time.Second})
			defer func() { require.NoError(t, rdb.Close()) }()
			const key = "{caughtup.feed.x}:k"
			require.NoError(t, rdb.Set(ctx, key, "v", 0).Err())
			old, err := c.MasterOf(ctx, key)
			require.NoError(t, err)
			// The write has reached the replica before the kill.
			require.NoError(t, rdb.Do(ctx, "WAIT", 1, 5000).Err())
			killed := time.Now()
			require.NoError(t, old.Kill())
			require.False(t, old.Running())
			require.NoError(t, c.WaitHealthy(ctx))
			took := time.Since(killed)
			nu, err := c.MasterOf(ctx, key)
			require.NoError(t, err)
			require.NotSame(t, old, nu)
			require.Eventually(t, func() bool { return rdb.Get(ctx, key).Val() == "v" }, 30*time.Second, 10*time.Millisecond)
			t.Logf("%s killed; %s serves its slots %v later; the client read from it %v after the kill", old.Name(), nu.Name(), took, time.Since(killed))

			restarted := time.Now()
			require.NoError(t, old.Start(ctx))
			require.NoError(t, c.WaitHealthy(ctx))
			t.Logf("%s restarted and rejoined within %v", old.Name(), time.Since(restarted))
			again, err := c.MasterOf(ctx, key)
			require.NoError(t, err)
			require.Same(t, nu, again, "the restarted node rejoined as a replica")
			require.NotEmpty(t, testsvc.ProcessesIn(dirs))
			require.NoError(t, c.Close())
			require.Empty(t, testsvc.ProcessesIn(dirs), "Close stops every node")
			t.Logf("closed")
		})
	}
}

// requireServiceUser checks that the processes in dirs run as the
// unprivileged service user when the test binary is root.
func requireServiceUser(t *testing.T, dirs []string) {
	t.Helper()
	cred, err := testsvc.ServiceCredential()
	require.NoError(t, err)
	if cred == nil {
		return // not root: our own user
	}
	pids := testsvc.ProcessesIn(dirs)
	require.NotEmpty(t, pids)
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		require.NoError(t, err)
		var uid string
		for _, line := range strings.Split(string(b), "\n") {
			if f := strings.Fields(line); len(f) > 1 && f[0] == "Uid:" {
				uid = f[1]
			}
		}
		require.Equal(t, strconv.Itoa(int(cred.Uid)), uid, "pid %d", pid)
	}
}

// TestSentinelFailover: the sentinels replace a SIGKILLed master with a
// replica, and a client through them writes to the new one.
func TestSentinelFailover(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := redistest.StartSentinel(ctx, redistest.SentinelOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	require.Len(t, s.SentinelAddrs(), 3)
	requireServiceUser(t, []string{s.Dir()})
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{MasterName: s.MasterName(), Addrs: s.SentinelAddrs(),
		DialTimeout: time.Second, ReadTimeout: time.Second})
	defer func() { require.NoError(t, rdb.Close()) }()
	require.NoError(t, rdb.Set(ctx, "k", "v", 0).Err())
	old, err := s.Master(ctx)
	require.NoError(t, err)
	require.Same(t, s.Servers()[0], old)
	require.NoError(t, rdb.Do(ctx, "WAIT", 2, 5000).Err())
	killed := time.Now()
	require.NoError(t, old.Kill())
	require.NoError(t, s.WaitSettled(ctx))
	took := time.Since(killed)
	nu, err := s.Master(ctx)
	require.NoError(t, err)
	require.NotSame(t, old, nu)
	t.Logf("%s killed; the sentinels settled on %s %v later", old.Name(), nu.Name(), took)
	require.Eventually(t, func() bool { return rdb.Set(ctx, "k2", "v", 0).Err() == nil }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, "v", rdb.Get(ctx, "k").Val())

	restarted := time.Now()
	require.NoError(t, old.Start(ctx))
	require.NoError(t, s.WaitSettled(ctx))
	t.Logf("%s restarted and re-pointed within %v", old.Name(), time.Since(restarted))
	again, err := s.Master(ctx)
	require.NoError(t, err)
	require.Same(t, nu, again, "the restarted master rejoined as a replica")
}

// TestStandalone: one redis-server, as the service user unless AsCaller,
// with Args after the harness's own, on a port that survives Kill and
// Start; Close stops it and removes its directory.
func TestStandalone(t *testing.T) {
	for _, asCaller := range []bool{false, true} {
		t.Run(map[bool]string{false: "service-user", true: "as-caller"}[asCaller], func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			s, err := redistest.StartStandalone(ctx, redistest.StandaloneOptions{AsCaller: asCaller, Args: []string{"--loglevel", "warning"}})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, s.Close()) })
			if asCaller {
				pids := testsvc.ProcessesIn([]string{s.Dir()})
				require.Len(t, pids, 1)
				fi, err := os.Stat("/proc/" + strconv.Itoa(pids[0]))
				require.NoError(t, err)
				require.Equal(t, uint32(os.Geteuid()), fi.Sys().(*syscall.Stat_t).Uid, "runs as the test binary")
			} else {
				requireServiceUser(t, []string{s.Dir()})
			}
			require.True(t, strings.HasPrefix(s.Server.Dir(), s.Dir()+"/"), "the server's directory is in the sandbox")

			rdb := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: time.Second})
			defer func() { require.NoError(t, rdb.Close()) }()
			require.Equal(t, map[string]string{"loglevel": "warning"}, rdb.ConfigGet(ctx, "loglevel").Val(), "Args come last")
			addr := s.Addr()
			require.NoError(t, s.Kill())
			require.False(t, s.Running())
			require.Error(t, rdb.Ping(ctx).Err())
			require.NoError(t, s.Start(ctx))
			require.Equal(t, addr, s.Addr())
			require.NoError(t, rdb.Ping(ctx).Err())

			require.NoError(t, s.Close())
			require.NoError(t, s.Close(), "Close is idempotent")
			require.False(t, s.Running())
			require.Error(t, s.Start(ctx), "a closed Standalone does not start again")
			require.NoDirExists(t, s.Dir())
		})
	}
}
