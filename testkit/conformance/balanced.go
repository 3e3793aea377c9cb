package conformance

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// Balanced is the fresh-reads scenario with the router's one replica pool
// behind an HAProxy that balances connections round robin over both
// standbys (a Kubernetes Service, a cloud reader endpoint), while replay
// pauses on one standby at a time. The tracker's connection watches one
// of them, the handlers' connections reach either: every job must still
// find its row, complete, and stay out of the queue's dead letters. Jobs
// whose connections kept reaching the paused standby fail without reading
// (consume.ErrReplicaBehind, consume.ReplicaFailed) and the adapter routes
// them again without counting an attempt; Report.ReplicaFailed counts
// them.
//
// The driver must implement DeadLetterCounter.
func Balanced(t *testing.T, cfg Config) Report {
	cfg = cfg.withDefaults()
	d := cfg.NewDriver(t)
	if _, ok := d.(DeadLetterCounter); !ok {
		t.Fatalf("conformance: the balanced scenario checks the queue's dead letters; %T does not implement DeadLetterCounter", d)
	}
	c := pgtest.Shared(t)
	h := proxytest.StartHAProxy(t, proxytest.HAProxyConfig{Backends: proxytest.Addrs(c.Replicas()...)})
	e := setupWith(t, cfg, func(db string) []replay.Replica {
		// Connections live a second, so that the pools keep reconnecting
		// through the balancer throughout: a connection on the standby
		// that is not watched is dropped when it is behind, and without
		// churn the handlers' pool can settle on the watched one.
		lb, err := pgxpool.New(t.Context(), fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&pool_max_conn_lifetime=1s", h.Addr(), db))
		require.NoError(t, err)
		t.Cleanup(lb.Close)
		return []replay.Replica{{Name: "haproxy", Pool: lb}}
	})
	// Paced, so that production spans several pauses of either standby
	// rather than ending inside the first.
	rep := routed(t, cfg, e, d, cfg.BalancedJobs, balancedRate, func(ctx context.Context) {
		pauseOneRandomly(ctx, e.cluster, cfg.MaxPause, 500*time.Millisecond, t.Errorf)
	})
	rep.Scenario = "BalancedPoolUnderRandomPauses"
	// Without this the balancer never mattered: every handler connection
	// reached the server the decisions judged.
	require.Positive(t, rep.Connections["verified"]+rep.Connections["behind"],
		"no routed handler connection reached the standby the tracker does not watch: the pool was not balanced")
	return rep
}

// balancedRate paces the balanced scenario's production: 1,000 jobs take
// five seconds.
const balancedRate = 200

// pauseOneRandomly pauses replay on one standby at a time, chosen at
// random, for a random spell of up to maxPause, resumes it, rests up to
// maxGap, and repeats until ctx ends; the standby is resumed when it
// returns. Behind a balancer one standby is then always caught up soon
// enough, so what is measured is where reads go, not how long jobs wait.
func pauseOneRandomly(ctx context.Context, c *pgtest.Cluster, maxPause, maxGap time.Duration, logf func(format string, args ...any)) {
	bg := context.Background() // resume even as ctx ends
	for ctx.Err() == nil {
		replicas := c.Replicas()
		if len(replicas) == 0 {
			return
		}
		n := replicas[rand.IntN(len(replicas))]
		if err := n.PauseReplay(bg); err != nil {
			logf("conformance: pause %s: %v", n.Name(), err)
		}
		sleepOrDone(ctx, rand.N(maxPause+1))
		if err := n.ResumeReplay(bg); err != nil {
			logf("conformance: resume %s: %v", n.Name(), err)
		}
		sleepOrDone(ctx, rand.N(maxGap+1))
	}
}

func sleepOrDone(ctx context.Context, d time.Duration) {
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-ctx.Done():
	case <-tm.C:
	}
}
