package lab

import (
	"context"
	"fmt"
	"net/url"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/testkit/redistest"
)

// The feed and the fleet budget on a Redis that fails over: a Redis
// Cluster (3 masters, 3 replicas; the feed uses sharded pub/sub, SPUBLISH
// and SSUBSCRIBE, on the master of its channel's slot) and a Sentinel set
// (a master, 2 replicas, 3 sentinels; classic pub/sub on the master),
// started for the scenario by testkit/redistest. The master that serves
// the feed is SIGKILLed mid-run and the cluster or the sentinels fail it
// over, while replay pauses at random and the sticky policy sends jobs
// whose replicas are behind to the primary through the budget. asynq's
// queues stay on the suite's own redis-server.

// scenarioBudgetRate is the fleet budget (per second, burst the same) of
// the scenarios that put one on the feed's Redis.
const scenarioBudgetRate = 20

// feedDeployment is a Redis that fails over, as a feed scenario uses it.
type feedDeployment struct {
	kind string // "cluster" or "sentinel"
	// client reaches it as the router does; url and mode are the
	// publishers' --redis and --redis-mode.
	client func() redis.UniversalClient
	url    string
	mode   string
	// budgetPrefix keeps the budget's key with the feed (same slot).
	budgetPrefix func(feedName string) string
	// killMaster SIGKILLs the master that serves feedName and names it.
	killMaster func(ctx context.Context, feedName string) (string, error)
	// settled waits until the deployment has a master again and every
	// node agrees.
	settled func(ctx context.Context) error
	close   func() error
}

// redisURL is a go-redis URL naming addrs (the first as the host, the
// rest as ?addr=) with the publishers' timeouts and extra parameters.
func redisURL(addrs []string, extra url.Values) string {
	q := url.Values{"dial_timeout": {"1s"}, "read_timeout": {"1s"}, "write_timeout": {"1s"}}
	for _, a := range addrs[1:] {
		q.Add("addr", a)
	}
	for k, v := range extra {
		q[k] = v
	}
	return "redis://" + addrs[0] + "?" + q.Encode()
}

func universalClient(o *redis.UniversalOptions) redis.UniversalClient {
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = 200*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
	return redis.NewUniversalClient(o)
}

func startFeedDeployment(ctx context.Context, kind string) (*feedDeployment, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	switch kind {
	case "cluster":
		rc, err := redistest.StartCluster(ctx, redistest.ClusterOptions{})
		if err != nil {
			return nil, fmt.Errorf("start a Redis Cluster: %w", err)
		}
		return &feedDeployment{
			kind:   kind,
			client: func() redis.UniversalClient { return universalClient(&redis.UniversalOptions{Addrs: rc.Addrs()}) },
			url:    redisURL(rc.Addrs(), nil),
			mode:   "cluster",
			// The feed's hash tag puts the budget's key in the feed's slot,
			// so that one kill takes both down.
			budgetPrefix: func(name string) string { return "caughtup.budget.{caughtup.feed." + name + "}." },
			killMaster: func(ctx context.Context, name string) (string, error) {
				m, err := rc.MasterOf(ctx, feed.ChannelName(name))
				if err != nil {
					return "", err
				}
				return m.Name(), m.Kill()
			},
			settled: rc.WaitHealthy,
			close:   rc.Close,
		}, nil
	case "sentinel":
		rs, err := redistest.StartSentinel(ctx, redistest.SentinelOptions{})
		if err != nil {
			return nil, fmt.Errorf("start a Sentinel set: %w", err)
		}
		return &feedDeployment{
			kind: kind,
			client: func() redis.UniversalClient {
				return universalClient(&redis.UniversalOptions{MasterName: rs.MasterName(), Addrs: rs.SentinelAddrs()})
			},
			url:          redisURL(rs.SentinelAddrs(), url.Values{"master_name": {rs.MasterName()}}),
			mode:         "sentinel",
			budgetPrefix: func(name string) string { return "caughtup.budget." + name + "." },
			killMaster: func(ctx context.Context, _ string) (string, error) {
				m, err := rs.Master(ctx)
				if err != nil {
					return "", err
				}
				return m.Name(), m.Kill()
			},
			settled: rs.WaitSettled,
			close:   rs.Close,
		}, nil
	}
	return nil, fmt.Errorf("no Redis deployment %q", kind)
}

func feedFailoverRedisScenario(kind, about string) func(sl scale) *scenario {
	return func(sl scale) *scenario {
		return feedScenarioWith(&scenario{
			name: "feed-redis-" + kind + "-failover",
			about: fmt.Sprintf("sticky policy; router on a signed feed of 2 publisher processes and a fleet budget (%d/s) on %s; "+
				"the master serving the feed SIGKILLed mid-run and failed over, random replay pauses", scenarioBudgetRate, about),
			policy: consume.Sticky,
			span:   func(s scale) time.Duration { return s.span(s.lead + 2*s.down + 2*s.tail) },
			fault:  feedRedisFailover,
			check: func(r *run, res *scenarioResult) {
				checkPartitions(r, res)
				checkBudget(r, false)
			},
		}, feedSetup{deployment: kind, budget: scenarioBudgetRate})
	}
}

var (
	feedRedisClusterFailoverScenario = feedFailoverRedisScenario("cluster",
		"a Redis Cluster of 3 masters and 3 replicas (sharded pub/sub on the master of the feed's slot, the budget's key in that slot)")
	feedRedisSentinelFailoverScenario = feedFailoverRedisScenario("sentinel",
		"a Sentinel set of 1 master, 2 replicas and 3 sentinels (classic pub/sub on the master)")
)

func feedRedisFailover(ctx context.Context, r *run) error {
	f := feedOf(r)
	st := partitionsOf(r)
	st.budgetUnavailable0 = budgetUnavailable(r)
	defer runPauser(r)()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	what := fmt.Sprintf("the %s master serving the feed SIGKILLed", f.deployment.kind)
	var killed string
	ff, err := observeFault(ctx, r, what, func() bool { return !r.env.router.Tracker().Feed().Active },
		func() (err error) {
			if killed, err = f.deployment.killMaster(ctx, f.name); err == nil {
				r.event("SIGKILLed %s, the %s master serving feed %s", killed, f.deployment.kind, f.name)
			}
			return err
		},
		// Over once the deployment has a master again; the router is over
		// it once it takes the feed again.
		func() (time.Time, error) {
			sctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			if err := f.deployment.settled(sctx); err != nil {
				return time.Time{}, fmt.Errorf("the %s did not fail %s over within a minute: %w", f.deployment.kind, killed, err)
			}
			return time.Now(), nil
		})
	if err != nil {
		return err
	}
	r.event("the %s failed %s over, %s after the kill; the router: %s", f.deployment.kind, killed, ff.healed.Sub(ff.from).Round(time.Millisecond), ff.timing())
	return r.at(ctx, r.sl.lead+2*r.sl.down)
}

// checkBudget says what the fleet budget answered, and how often it could
// not (counted; the per-process cap alone then applied). It fails the run
// if the budget never answered, or, with unreachable (the fault cut it
// off), if no check found it unavailable.
func checkBudget(r *run, unreachable bool) {
	st := partitionsOf(r)
	by := r.metrics.sum("caughtup.consume.fallback.budget", "caughtup.result")
	unavailable := budgetUnavailable(r) - st.budgetUnavailable0
	r.note("fleet budget checks by result (caughtup.consume.fallback.budget): %s; unavailable during the run: %d (the per-process cap alone applied to those)",
		sortedCounts(by), unavailable)
	if by["allowed"]+by["spent"] == 0 {
		r.fail("the fleet budget never answered: the replay pauses sent no job to the primary through it")
	}
	if unreachable && unavailable == 0 {
		r.fail("no fallback found the fleet budget unavailable: the partition did not reach it")
	}
}

// publisherRedis is the --redis and --redis-mode of the scenario's
// publishers: the deployment's, else the suite's redis-server.
func (f *feedRun) publisherRedis(r *run) (string, string) {
	if f.deployment != nil {
		return f.deployment.url, f.deployment.mode
	}
	return "redis://" + r.s.redis.Addr() + "/0?dial_timeout=1s&read_timeout=1s&write_timeout=1s", "single"
}
