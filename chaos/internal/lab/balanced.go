package lab

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// The balanced scenario: the router's one replica pool is an endpoint
// that balances connections over both standbys, as a Kubernetes Service,
// an LVS virtual IP or a cloud reader endpoint does. The tracker's
// connection watches one standby; a handler's connection may reach either,
// so each routed acquire is checked against the server the decision
// judged (consume's connection check). Replay pauses on one standby at a
// time: the other is then caught up, and a job whose connections keep
// reaching the paused one fails without reading and is retried.

// balancedGap bounds the rest between two pauses.
const balancedGap = 500 * time.Millisecond

func balancedScenario(sl scale) *scenario {
	return &scenario{
		name: "balanced",
		about: fmt.Sprintf("the router's one replica pool is an HAProxy balancing connections round robin over both standbys "+
			"(testkit/proxytest; a Kubernetes Service, a cloud reader endpoint); replay paused on one standby at a time, chosen at random, "+
			"for up to %s, with rests of up to %s; the kafka-go Consumers route by themselves", sl.maxPause, balancedGap),
		policy:       consume.Delayed,
		replicaPools: balancedPools,
		// A read whose connections met only the paused standby is the
		// router's to route again, not the message's attempt.
		kafkaRoutes: true,
		span:        func(s scale) time.Duration { return s.span(s.lead + 4*s.maxPause + s.tail) },
		fault:       pauseOneAtATime,
		check:       checkBalanced,
	}
}

type balancedState struct {
	haproxy *proxytest.HAProxy
	pauses  map[string]int
	paused  time.Duration // summed over the pauses
}

func balancedOf(r *run) *balancedState {
	st, _ := r.state.(*balancedState)
	return st
}

// balancedPools starts an HAProxy over the cluster's standbys and returns
// one pool through it.
func balancedPools(ctx context.Context, r *run) ([]replay.Replica, error) {
	h, err := proxytest.NewHAProxy(ctx, proxytest.HAProxyConfig{Backends: proxytest.Addrs(r.cluster.Replicas()...)})
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, func() { _ = h.Close() })
	cfg, err := pgxpool.ParseConfig(fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", h.Addr(), r.env.name))
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 24 // as newDBEnv's pool per standby
	// Connections live a second, so that the pools keep reconnecting
	// through the balancer throughout: a connection on the standby that is
	// not watched is dropped when it is behind, and without churn the
	// handlers' pool can settle on the watched one.
	cfg.MaxConnLifetime, cfg.MaxConnLifetimeJitter = time.Second, 200*time.Millisecond
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, p.Close)
	r.state = &balancedState{haproxy: h, pauses: map[string]int{}}
	return []replay.Replica{{Name: "haproxy", Pool: p}}, nil
}

// pauseOneAtATime pauses replay on one standby at a time, chosen at
// random, from the lead until the tail, for up to maxPause each.
func pauseOneAtATime(ctx context.Context, r *run) error {
	st := balancedOf(r)
	nodes := r.cluster.Replicas()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	defer resumeAll(nodes)
	end := r.start.Add(r.sc.span(r.sl) - r.sl.tail)
	for time.Now().Before(end) {
		n := nodes[rand.IntN(len(nodes))]
		if err := n.PauseReplay(ctx); err != nil {
			return err
		}
		from := time.Now()
		if len(st.pauses) == 0 {
			r.event("first pause: replay on %s, behind the HAProxy on %s (round robin over %s)", n.Name(), st.haproxy.Addr(), names(nodes))
		}
		st.pauses[n.Name()]++
		sleepCtx(ctx, min(rand.N(r.sl.maxPause+1), time.Until(end)))
		if err := resumeAll([]*pgtest.Node{n}); err != nil {
			return err
		}
		st.paused += time.Since(from)
		if !sleepCtx(ctx, rand.N(balancedGap+1)) {
			return ctx.Err()
		}
	}
	r.event("pauses done: %v, %.1fs paused in all, never both standbys at once", st.pauses, st.paused.Seconds())
	return nil
}

// checkBalanced says what the connection check did, and fails the run if
// the fault or the balancer did not take effect.
func checkBalanced(r *run, res *scenarioResult) {
	st := balancedOf(r)
	conns := r.metrics.sum("caughtup.consume.replica.connections", "caughtup.result")
	r.note("routed acquires of replica connections (caughtup.consume.replica.connections): same server %d, verified on the other %d, behind and dropped %d; "+
		"replica exclusions %v", conns["same_server"], conns["verified"], conns["behind"],
		r.metrics.sum("caughtup.consume.replica.exclusions", "caughtup.reason"))
	if st == nil || len(st.pauses) == 0 {
		r.fail("replay was never paused")
	}
	if conns["verified"]+conns["behind"] == 0 {
		r.fail("no routed handler connection reached the standby the tracker does not watch: the balancer never mattered")
	}
}
