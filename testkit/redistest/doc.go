// Package redistest starts throwaway Redis deployments that fail over for
// integration tests: a Redis Cluster (StartCluster: 3 masters and 3
// replicas by default) and a Sentinel set (StartSentinel: a master, 2
// replicas and 3 sentinels with quorum 2 by default), with short timeouts
// so that a killed master is replaced within a few seconds, and a single
// redis-server (StartStandalone, which testkit/pgtest's StartRedis wraps).
//
// Everything runs from the machine's redis-server on loopback ports that
// testkit/testsvc hands out (a killed server's port stays reserved until
// it is started again), as the unprivileged service user when the test
// binary is root (a Standalone with AsCaller runs as the test binary), with
// the working directory inside a testsvc.Sandbox, so
// that Close, the SIGINT/SIGTERM handler or the sandbox's watchdog (when
// the test binary dies, even of SIGKILL) stops every process.
//
//	c, err := redistest.StartCluster(ctx, redistest.ClusterOptions{})
//	defer c.Close()
//	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: c.Addrs()})
//	m, err := c.MasterOf(ctx, "{caughtup.feed.default}:obs")
//	err = m.Kill() // SIGKILL; its replica takes over within a few seconds
//	err = c.WaitHealthy(ctx)
//
//	s, err := redistest.StartSentinel(ctx, redistest.SentinelOptions{})
//	defer s.Close()
//	rdb := redis.NewUniversalClient(&redis.UniversalOptions{MasterName: s.MasterName(), Addrs: s.SentinelAddrs()})
//	m, err := s.Master(ctx)
//	err = m.Kill()
//	err = s.WaitSettled(ctx) // a replica is master, the other follows it
package redistest
