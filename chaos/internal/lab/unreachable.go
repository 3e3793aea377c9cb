package lab

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The unreachable-replica scenario (issue 36 §2): replica1 stays out of
// the handlers' reach for a long stretch while the tracker calls it
// healthy. The router's pool for replica1 reaches it through a
// testkit/fault proxy, except for the tracker's connections (named
// replay.ApplicationName), which go to it directly, as a feed's
// publishers on another host would; for scale.unreachable the proxy
// resets every new connection, and the handlers' connections it carried
// are cut when that starts. Meanwhile replica2's replay is paused twice,
// for a quarter of that stretch each, at its start and halfway: replica1
// is then the one replica the tracker calls caught up, and the one the
// handlers cannot reach. Every pipeline runs (asynq, kafka-go in place and
// retry topic with the Consumers routing by themselves, River in both
// lanes, franz-go).
//
// A replica's failure of a run is the router's, not the job's: every job
// must be handled, none dead-lettered, none stale, and none may complete
// with a retry count above 0 (no handler error other than the replica's
// is expected here, so any would be an attempt the failure spent).

func unreachableScenario(sl scale) *scenario {
	return &scenario{
		name: "unreachable-replica",
		about: fmt.Sprintf("replica1's new handler connections reset by a proxy for %s (its live ones cut) while the tracker, reaching it directly, "+
			"calls it healthy; replica2's replay paused for %s at the start of that and again halfway; every pipeline at once "+
			"(asynq, kafka-go in place and retry topic with the Consumers routing, River, franz-go)", sl.unreachable, unreachablePause(sl)),
		policy:       consume.Delayed,
		retryTopic:   true,
		river:        true,
		kgo:          true,
		kafkaRoutes:  true,
		replicaPools: unreachablePools,
		span:         func(s scale) time.Duration { return s.span(s.lead + s.unreachable + s.tail) },
		fault:        unreachableFault,
		check:        checkUnreachable,
	}
}

// unreachablePause is how long each of replica2's pauses lasts.
func unreachablePause(sl scale) time.Duration { return sl.unreachable / 4 }

type unreachableState struct {
	proxy      *fault.Proxy
	far, near  *pgtest.Node
	refusedAt  time.Time
	acceptedAt time.Time
	cut        int
	// trackerSamples and trackerHealthy count the samples of the
	// tracker's own view of replica1 taken while it refused, and those in
	// which it called replica1 usable.
	trackerSamples, trackerHealthy atomic.Int64
	// excluded records when the router's view had replica1 left out.
	excluded *condLog
}

func unreachableOf(r *run) *unreachableState {
	st, _ := r.state.(*unreachableState)
	return st
}

// unreachablePools returns replica1's pool through the proxy (the
// tracker's connections around it) and a direct pool to replica2.
func unreachablePools(ctx context.Context, r *run) ([]replay.Replica, error) {
	nodes := r.cluster.Replicas()
	far, near := nodes[0], nodes[1]
	direct := net.JoinHostPort("127.0.0.1", strconv.Itoa(far.Port()))
	proxy, err := fault.NewProxy(direct)
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, func() { _ = proxy.Close() })
	cfg, err := pgxpool.ParseConfig(fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&connect_timeout=2", proxy.Addr(), r.env.name))
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 24 // as newDBEnv's pool per standby
	port := uint16(far.Port())
	cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
		if cc.RuntimeParams["application_name"] == replay.ApplicationName {
			cc.Host, cc.Port = "127.0.0.1", port
		}
		return nil
	}
	farPool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, farPool.Close)
	ncfg, err := pgxpool.ParseConfig(near.DSN(r.env.name))
	if err != nil {
		return nil, err
	}
	ncfg.MaxConns = 24
	nearPool, err := pgxpool.NewWithConfig(ctx, ncfg)
	if err != nil {
		return nil, err
	}
	r.closers = append(r.closers, nearPool.Close)
	r.state = &unreachableState{proxy: proxy, far: far, near: near}
	return []replay.Replica{{Name: far.Name(), Pool: farPool}, {Name: near.Name(), Pool: nearPool}}, nil
}

// unreachableFault makes replica1 refuse the handlers from the lead for
// scale.unreachable, and pauses replica2 twice meanwhile.
func unreachableFault(ctx context.Context, r *run) error {
	st := unreachableOf(r)
	router := r.env.router
	st.excluded = watchCond(func() bool {
		db := router.Snapshot().Database("main")
		return db == nil || db.Replicas[0].Err != nil
	})
	defer st.excluded.stop()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	defer st.proxy.Accept()
	defer resumeAll([]*pgtest.Node{st.near})
	st.proxy.Refuse()
	st.cut = st.proxy.Cut()
	st.refusedAt = time.Now()
	r.event("%s resets every new handler connection (%d live ones cut); the tracker reaches it directly", st.far.Name(), st.cut)

	sctx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		st.sampleTracker(sctx, router)
	}()
	defer func() {
		stopSampling()
		<-sampled
	}()

	d, p := r.sl.unreachable, unreachablePause(r.sl)
	for _, at := range []time.Duration{0, d / 2} {
		if err := r.at(ctx, r.sl.lead+at); err != nil {
			return err
		}
		if err := st.near.PauseReplay(ctx); err != nil {
			return err
		}
		r.event("paused replay on %s: %s, which the handlers cannot reach, is the one replica the tracker calls caught up", st.near.Name(), st.far.Name())
		if err := r.at(ctx, r.sl.lead+at+p); err != nil {
			return err
		}
		if err := resumeAll([]*pgtest.Node{st.near}); err != nil {
			return err
		}
		r.event("resumed replay on %s", st.near.Name())
	}
	if err := r.at(ctx, r.sl.lead+d); err != nil {
		return err
	}
	stopSampling()
	<-sampled
	st.proxy.Accept()
	st.acceptedAt = time.Now()
	accepted, _, _ := st.proxy.Stats()
	r.event("%s accepts connections again (%d asked of the proxy in all); the tracker called it usable in %d of %d samples meanwhile",
		st.far.Name(), accepted, st.trackerHealthy.Load(), st.trackerSamples.Load())
	return nil
}

// sampleTracker samples the tracker's own view of replica1 every 50ms
// until ctx ends.
func (st *unreachableState) sampleTracker(ctx context.Context, router *consume.Router) {
	bound := router.Config().Tracker.StalenessBound
	for ctx.Err() == nil {
		if db := router.Tracker().Snapshot().Database("main"); db != nil {
			rs := db.Replicas[0]
			st.trackerSamples.Add(1)
			if rs.Err == nil && rs.Usable(time.Now().Add(-bound)) {
				st.trackerHealthy.Add(1)
			}
		}
		sleepCtx(ctx, 50*time.Millisecond)
	}
}

// checkUnreachable: no attempt spent and nothing dead-lettered in any
// pipeline; the fault took effect (the router left replica1 out while the
// tracker called it healthy, and jobs waited for replica2).
func checkUnreachable(r *run, res *scenarioResult) {
	st := unreachableOf(r)
	if st == nil || st.refusedAt.IsZero() {
		r.fail("replica1 never refused connections")
		return
	}
	excl := r.metrics.sumBy("caughtup.consume.replica.exclusions", "caughtup.replica", "caughtup.reason")
	var kafka []string
	by := r.metrics.sumBy("caughtup.kafka.messages", "caughtup.kafka.result")
	for _, k := range []string{"rerouted", "retried", "dead_lettered"} {
		kafka = append(kafka, fmt.Sprintf("%s %d", k, by[k]))
	}
	first, seen := st.excluded.first(st.refusedAt, true)
	excludedAfter := "never"
	if seen {
		excludedAfter = first.Sub(st.refusedAt).Round(time.Millisecond).String()
	}
	back := "not within the run"
	if !st.acceptedAt.IsZero() {
		if t, ok := st.excluded.first(st.acceptedAt, false); ok {
			back = t.Sub(st.acceptedAt).Round(time.Millisecond).String() + " after it accepted again"
		}
	}
	r.note("replica exclusions (caughtup.consume.replica.exclusions) by replica and reason: %v; the router first left %s out %s after the refusal began, "+
		"and took it back %s; Kafka consumers' results (both adapters): %s", excl, st.far.Name(), excludedAfter, back, strings.Join(kafka, ", "))
	r.noteReplicaFailed(res)
	r.note("primary reads by reason: %v", r.primaryReasons())

	if n := excl[st.far.Name()+"/unreachable"]; n == 0 {
		r.fail("the router never left %s out as unreachable", st.far.Name())
	}
	if n, healthy := st.trackerSamples.Load(), st.trackerHealthy.Load(); n == 0 || healthy*10 < n*9 {
		r.fail("the tracker called %s usable in only %d of %d samples during the refusal: the scenario did not test a replica the tracker calls healthy", st.far.Name(), healthy, n)
	}
	waited := 0
	for _, sr := range res.Streams[:len(res.Streams)-1] {
		if sr.Jobs == 0 {
			r.fail("%s: no job went through it", sr.Stream)
		}
		if sr.DeadLetters > 0 {
			r.fail("%s: %d jobs dead-lettered", sr.Stream, sr.DeadLetters)
		}
		if sr.RetriedRuns > 0 {
			r.fail("%s: %d jobs completed with a retry count above 0: a replica's failure spent an attempt", sr.Stream, sr.RetriedRuns)
		}
		waited += sr.Outcomes[consume.OutcomeReplicaWaited.String()] + sr.Deferrals
	}
	if waited == 0 {
		r.fail("no job waited for a replica or was deferred: replica2's pauses did not take effect")
	}
}
