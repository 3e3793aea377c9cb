package lab

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// scenarios returns the fault scenarios in the order they run.
func scenarios(sl scale) []*scenario {
	out := make([]*scenario, 0, len(scenarioList))
	for _, f := range scenarioList {
		out = append(out, f(sl))
	}
	return out
}

// scenarioList is the running order. A new scenario goes in a file of its
// own, with a constructor added here on a line of its own.
var scenarioList = []func(sl scale) *scenario{
	replayPauseScenario,
	replicaCrashScenario,
	failoverScenario,
	trackerWedgeScenario,
	redisRestartScenario,
	consumersScenario,
	replayConflictScenario,
	lagSpikeCapScenario,
	divergedStandbyScenario,           // diverged.go
	timeoutTasksScenario,              // timeouts.go
	feedPublisherKillScenario,         // feedscenarios.go
	feedPublishersStoppedScenario,     // feedscenarios.go
	feedRedisRestartScenario,          // feedscenarios.go
	feedPublisherSigstopScenario,      // feedscenarios.go
	feedFailoverScenario,              // feedscenarios.go
	forgedFeedScenario,                // forged.go
	balancedScenario,                  // balanced.go
	weightedScenario,                  // weighted.go
	unreachableScenario,               // unreachable.go
	partitionReplicaScenario,          // partitions.go
	partitionAsymmetricScenario,       // partitions.go
	partitionLatencyScenario,          // partitions.go
	partitionFeedRedisScenario,        // partitions.go
	partitionPublisherScenario,        // partitions.go
	feedRedisClusterFailoverScenario,  // feedredis.go
	feedRedisSentinelFailoverScenario, // feedredis.go
	adaptersScenario,                  // adapters.go
	adaptersPauseScenario,             // adapters.go
}

func replayPauseScenario(sl scale) *scenario {
	return &scenario{
		name: "replay-pause",
		about: fmt.Sprintf("WAL replay paused on both replicas for %s mid-run (delayed policy: wait, defer, run once replay resumes); "+
			"Kafka in both modes (in place, retry topic)", sl.pause),
		policy:     consume.Delayed,
		retryTopic: true,
		span:       func(s scale) time.Duration { return s.span(s.lead + s.pause + s.tail) },
		fault:      replayPause,
		check:      expectDeferrals,
	}
}

func replicaCrashScenario(sl scale) *scenario {
	return &scenario{
		name:   "replica-crash",
		about:  fmt.Sprintf("replica1 SIGKILLed and restarted after %s, then replica2 the same (Node.Kill/Start, crash recovery)", sl.down),
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + 2*s.down + s.down/2 + s.tail) },
		fault:  replicaCrash,
		check:  checkCrash,
	}
}

func failoverScenario(sl scale) *scenario {
	return &scenario{
		name: "failover",
		about: "replica1 promoted mid-run on a cluster of its own (clean switchover, primary changes, timeline 1 -> 2); producers and router follow " +
			"the new primary; 40% of jobs are enqueued 0.2-3s after their write, so jobs written on timeline 1 run after the switch",
		fresh:  true,
		policy: consume.Delayed,
		delay:  lateEnqueue,
		span:   func(s scale) time.Duration { return s.span(s.lead + 2*s.down + s.tail) },
		fault:  failover,
		check:  checkFailover,
	}
}

func trackerWedgeScenario(sl scale) *scenario {
	return &scenario{
		name:   "tracker-wedge",
		about:  fmt.Sprintf("the tracker's replica backends SIGSTOPped for %s and its new replica connections held: positions stop updating", sl.wedge),
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + s.wedge + s.tail) },
		fault:  trackerWedge,
		check:  checkWedge,
	}
}

func redisRestartScenario(sl scale) *scenario {
	return &scenario{
		name: "redis-restart",
		about: fmt.Sprintf("redis-server stopped (SIGTERM) for %s and started again, with persistence switched on at runtime; "+
			"replay paused from %s before the stop until Redis is back, so that tasks queue up in Redis", sl.redisDown, redisPrePause),
		policy: consume.Delayed,
		// No attempt may end while Redis is down (see redisRestart):
		// tasks wait in process through the pause and the outage.
		router: func(c *consume.Config) { c.WaitBudget = redisPrePause + sl.redisDown + 3*time.Second },
		span: func(s scale) time.Duration {
			return s.span(s.lead + redisPrePause + s.redisDown + 2*s.tail)
		},
		fault: redisRestart,
		check: checkRedis,
	}
}

func consumersScenario(sl scale) *scenario {
	return &scenario{
		name: "consumers",
		about: "asynq: Server.Shutdown mid-run and a new server, later a second one; kafka: a member killed (connections reset, no commit, no leave), " +
			"a replacement, a third member joining (rebalance) and leaving",
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + 5*s.consumers + s.tail) },
		fault:  consumerChurn,
		check:  checkChurn,
	}
}

func replayConflictScenario(sl scale) *scenario {
	return &scenario{
		name: "replay-conflict",
		about: fmt.Sprintf("a REPEATABLE READ query held on each replica while the primary DELETEs and VACUUMs rows it can see: replay stalls "+
			"(replica1 until max_standby_streaming_delay=%s cancels the query, replica2 until released after %s)", sl.standbyDelay, sl.holdShort),
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + s.holdLong + s.tail) },
		fault:  replayConflict,
		check:  checkConflict,
	}
}

func lagSpikeCapScenario(sl scale) *scenario {
	return &scenario{
		name: "lag-spike-cap",
		about: fmt.Sprintf("sticky policy with the fallback cap at 20/s, burst 20; replay paused on both replicas for %s; "+
			"River and franz-go beside asynq and Kafka", sl.capPause),
		policy: consume.Sticky,
		// A refusal fails a River attempt (River retries it) and holds a
		// franz-go record in place: the cap is shared by every pipeline.
		river:  true,
		kgo:    true,
		router: func(c *consume.Config) { c.PrimaryRate, c.PrimaryBurst = rate.Limit(20), 20 },
		span:   func(s scale) time.Duration { return s.span(s.lead + s.capPause + s.tail) },
		fault:  capSpike,
		check:  checkCap,
	}
}

func pauseAll(ctx context.Context, nodes []*pgtest.Node) error {
	for _, n := range nodes {
		if err := n.PauseReplay(ctx); err != nil {
			return err
		}
	}
	return nil
}

func resumeAll(nodes []*pgtest.Node) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var errs []error
	for _, n := range nodes {
		if n.Running() {
			errs = append(errs, n.ResumeReplay(ctx))
		}
	}
	return errors.Join(errs...)
}

func names(nodes []*pgtest.Node) string {
	var s []string
	for _, n := range nodes {
		s = append(s, n.Name())
	}
	return strings.Join(s, ", ")
}

func replayPause(ctx context.Context, r *run) error {
	return pauseAllFor(ctx, r, r.sl.pause, "")
}

// pauseAllFor pauses replay on every replica from the scenario's lead time
// for d, then resumes it.
func pauseAllFor(ctx context.Context, r *run, d time.Duration, why string) error {
	return pauseAllAt(ctx, r, r.sl.lead, d, why)
}

// pauseAllAt pauses replay on every replica from from (after the
// scenario's start) for d, then resumes it, and records the span.
func pauseAllAt(ctx context.Context, r *run, from, d time.Duration, why string) error {
	nodes := r.cluster.Replicas()
	if err := r.at(ctx, from); err != nil {
		return err
	}
	defer resumeAll(nodes)
	if err := pauseAll(ctx, nodes); err != nil {
		return err
	}
	r.event("paused replay on %s%s", names(nodes), why)
	span := pauseSpan{from: time.Now()}
	if err := r.at(ctx, from+d); err != nil {
		return err
	}
	span.to = time.Now()
	r.mu.Lock()
	r.pausedAll = append(r.pausedAll, span)
	r.mu.Unlock()
	if err := resumeAll(nodes); err != nil {
		return err
	}
	r.event("resumed replay on %s", names(nodes))
	return nil
}

// expectDeferrals fails a scenario whose fault never made a job wait:
// it would have proven nothing.
func expectDeferrals(r *run, res *scenarioResult) {
	all := res.Streams[len(res.Streams)-1]
	if all.Deferrals == 0 {
		r.fail("no job was deferred: the fault did not take effect")
	}
}

// watchReplica waits until the router's tracker reports replica idx as
// unusable (failing) or usable again, and returns how long that took.
func (r *run) watchReplica(ctx context.Context, idx int, failing bool) (time.Duration, bool) {
	start := time.Now()
	for time.Since(start) < 15*time.Second && ctx.Err() == nil {
		if db := r.env.router.Snapshot().Database("main"); db != nil && idx < len(db.Replicas) {
			st := db.Replicas[idx]
			if (st.Err != nil) == failing && (failing || st.ObservedAt.After(start)) {
				return time.Since(start), true
			}
		}
		sleepCtx(ctx, 10*time.Millisecond)
	}
	return time.Since(start), false
}

func replicaCrash(ctx context.Context, r *run) error {
	_, err := crashReplicas(ctx, r, r.sl.lead, func(op func() error) error { return op() })
	return err
}

// crashReplicas SIGKILLs each replica in turn from t on, watches the
// tracker notice it (crashesSeen), and restarts it a down time later;
// guard runs each kill and restart (the adapters scenario holds its
// replay pauser off the node meanwhile). It returns the schedule's time
// after the last restart.
func crashReplicas(ctx context.Context, r *run, t time.Duration, guard func(op func() error) error) (time.Duration, error) {
	for i, n := range r.cluster.Replicas() {
		if err := r.at(ctx, t); err != nil {
			return t, err
		}
		var killed time.Time
		if err := guard(func() error { killed = time.Now(); return n.Kill() }); err != nil {
			return t, fmt.Errorf("kill %s: %w", n.Name(), err)
		}
		r.event("SIGKILLed %s", n.Name())
		if _, ok := r.watchReplica(ctx, i, true); ok {
			r.event("tracker marks %s unreadable %s after the SIGKILL", n.Name(), time.Since(killed).Round(time.Millisecond))
			r.mu.Lock()
			r.crashesSeen++
			r.mu.Unlock()
		}
		t += r.sl.down
		if err := r.at(ctx, t); err != nil {
			return t, err
		}
		var began time.Time
		if err := guard(func() error { began = time.Now(); return n.Start(ctx) }); err != nil {
			return t, fmt.Errorf("restart %s: %w", n.Name(), err)
		}
		r.event("restarted %s (crash recovery, streaming again after %s)", n.Name(), time.Since(began).Round(time.Millisecond))
		t += r.sl.down / 2
	}
	return t, nil
}

// checkCrash: the router must have noticed each crash, or the scenario
// ran against replicas it never knew were gone.
func checkCrash(r *run, res *scenarioResult) {
	r.mu.Lock()
	seen := r.crashesSeen
	r.mu.Unlock()
	if want := len(r.env.replicaNodes); seen != want {
		r.fail("the tracker noticed %d of %d replica crashes", seen, want)
	}
}

func failover(ctx context.Context, r *run) error {
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	target := r.cluster.Replicas()[0]
	r.mu.Lock()
	r.failoverStart = time.Now()
	r.mu.Unlock()
	r.event("promoting %s: old primary shut down cleanly, then pg_promote, then the other replica re-pointed", target.Name())
	if err := r.cluster.Promote(ctx, target); err != nil {
		return fmt.Errorf("promote %s: %w", target.Name(), err)
	}
	r.mu.Lock()
	r.failoverEnd = time.Now()
	r.mu.Unlock()
	tli, err := target.Timeline(ctx)
	if err != nil {
		return err
	}
	r.event("%s is the primary on timeline %d (promotion took %s); remaining replicas: %s",
		target.Name(), tli, r.failoverEnd.Sub(r.failoverStart).Round(time.Millisecond), names(r.cluster.Replicas()))
	// The router was built before the promotion. Its tracker must now see
	// the new primary's timeline and the promoted node out of recovery.
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		db := r.env.router.Snapshot().Database("main")
		if db != nil && db.Primary.Epoch.Timeline == tli && db.Primary.HistoryKnown && !db.Replicas[0].InRecovery && db.Replicas[0].Err == nil {
			r.event("tracker: primary epoch %s (history known), %s out of recovery and no longer used as a replica", db.Primary.Epoch, target.Name())
			return nil
		}
		sleepCtx(ctx, 20*time.Millisecond)
	}
	return errors.New("the router's tracker did not see the promotion within 15s")
}

// lateEnqueue delays 40% of the enqueues by 0.2-3s, as an outbox relay or
// a job scheduled for later would.
func lateEnqueue(r *rand.Rand) time.Duration {
	if r.Float64() < 0.6 {
		return 0
	}
	return 200*time.Millisecond + time.Duration(r.Int64N(int64(2800*time.Millisecond)))
}

func checkFailover(r *run, res *scenarioResult) {
	r.mu.Lock()
	from, to := r.failoverStart, r.failoverEnd
	r.mu.Unlock()
	if to.IsZero() {
		return
	}
	pre, stale := 0, 0
	for _, st := range r.streams() {
		st.mu.Lock()
		for _, rd := range st.reads {
			if time.Unix(0, rd.job.Committed).Before(from) && rd.at.After(to) {
				pre++
				if rd.stale {
					stale++
				}
			}
		}
		st.mu.Unlock()
	}
	r.note("%d reads after the promotion were of jobs committed on timeline 1 before it; %d of them stale", pre, stale)
	if pre == 0 {
		r.fail("no job written before the promotion was read after it: the failover was not exercised")
	}
}

func trackerWedge(ctx context.Context, r *run) error {
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	nodes := r.env.replicaNodes
	ctrl := make([]*pgx.Conn, len(nodes))
	for i, n := range nodes {
		c, err := pgx.Connect(ctx, n.DSN(r.env.name))
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		ctrl[i] = c
	}
	var (
		stopped  []int
		lastStop time.Time
	)
	stopNew := func() (int, error) {
		n := 0
		for i, c := range ctrl {
			rows, err := c.Query(ctx, `SELECT pid FROM pg_stat_activity
				WHERE datname = $1 AND state = 'idle' AND application_name = $2 AND pid <> pg_backend_pid()`, r.env.name, replay.ApplicationName)
			if err != nil {
				return n, fmt.Errorf("%s: %w", nodes[i].Name(), err)
			}
			pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
			if err != nil {
				return n, err
			}
			for _, pid := range pids {
				if slices.Contains(stopped, int(pid)) {
					continue
				}
				if err := syscall.Kill(int(pid), syscall.SIGSTOP); err != nil {
					return n, fmt.Errorf("SIGSTOP %d on %s: %w", pid, nodes[i].Name(), err)
				}
				stopped = append(stopped, int(pid))
				lastStop = time.Now()
				n++
			}
		}
		return n, nil
	}
	cont := func() {
		for _, pid := range stopped {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
	defer cont()
	defer r.env.replicaDialer.Release()

	// New connections first, so the tracker cannot replace a stopped
	// backend with a fresh one; then every tracker backend, one per
	// replica (it may be busy for a moment: only idle ones are stopped,
	// so that none is frozen holding a snapshot).
	r.env.replicaDialer.Hold()
	deadline := time.Now().Add(2 * time.Second)
	for {
		if _, err := stopNew(); err != nil {
			return err
		}
		if n := len(stopped); n >= len(nodes) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("found %d tracker backends on %d replicas: the wedge cannot take effect", len(stopped), len(nodes))
		}
		sleepCtx(ctx, 5*time.Millisecond)
	}
	r.event("wedged: SIGSTOPped tracker backends (pids %v); new replica connections held", stopped)
	late := 0
	for time.Since(r.start) < r.sl.lead+r.sl.wedge && ctx.Err() == nil {
		n, err := stopNew()
		if err != nil {
			return err
		}
		late += n
		sleepCtx(ctx, 20*time.Millisecond)
	}
	_, _, held := r.env.replicaDialer.Stats()
	r.env.replicaDialer.Release()
	end := time.Now()
	cont()
	r.mu.Lock()
	r.wedgeFrom, r.wedgeTo = lastStop, end
	r.mu.Unlock()
	r.event("released: SIGCONT, %d held reconnections let through (%d tracker backends stopped after the first round)", held, late)
	return nil
}

// checkWedge: once the last observation the tracker could have made is
// older than the staleness bound, no job may read a replica until the
// wedge ends.
func checkWedge(r *run, res *scenarioResult) {
	r.mu.Lock()
	from, to := r.wedgeFrom, r.wedgeTo
	r.mu.Unlock()
	if to.IsZero() {
		return
	}
	bound := r.env.router.Config().Tracker.StalenessBound
	start := from.Add(bound)
	if to.Sub(start) < r.sl.wedge/2 {
		r.fail("the wedge held for only %s past the staleness bound", to.Sub(start))
		return
	}
	primary, replica := 0, 0
	for _, st := range r.streams() {
		for _, rd := range st.readsBetween(start, to) {
			if rd.replica != "" {
				replica++
				if replica <= 5 {
					r.fail("%s job %d read %s at %s, %s into the wedge, past the staleness bound", st.name, rd.job.ID, rd.replica,
						rd.decided.Format("15:04:05.000"), rd.decided.Sub(from).Round(time.Millisecond))
				}
			} else {
				primary++
			}
		}
	}
	r.note("wedge window %s (from the last stop + staleness bound %s to release): %d reads decided in it, %d on the primary, %d on a replica",
		to.Sub(start).Round(time.Millisecond), bound, primary+replica, primary, replica)
	if replica > 0 {
		r.fail("%d jobs read a replica while the tracker was wedged", replica)
	}
	if primary == 0 && res.Streams[len(res.Streams)-1].Deferrals == 0 {
		r.fail("no job ran or was deferred during the wedge: it was not exercised")
	}
}

// redisRestart restarts redis-server while jobs sit in it: replay is
// paused on both replicas from a moment before the stop until Redis is
// back, so the workers wait for a replica and asynq tasks pile up in Redis,
// where they are when it goes down; without persistence they would be
// gone. The scenario's wait budget outlasts the pause, so that tasks wait
// in process rather than being deferred while Redis is down: asynq v0.26
// cannot record the outcome of an attempt that ends during an outage (it
// queues the write for a retry with a context it has already cancelled),
// so such a task stays "active" until its lease expires and the recoverer
// (every minute, 30s grace) runs it again, one to two minutes later. For a
// completed task that is a harmless duplicate; for a deferral it is a
// delay that is asynq's, not caughtup's.
func redisRestart(ctx context.Context, r *run) error {
	nodes := r.cluster.Replicas()
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	defer resumeAll(nodes)
	if err := pauseAll(ctx, nodes); err != nil {
		return err
	}
	r.event("paused replay on %s, so that tasks queue up in Redis", names(nodes))
	if err := r.at(ctx, r.sl.lead+redisPrePause); err != nil {
		return err
	}
	insp := asynq.NewInspector(r.s.redisOpt())
	defer insp.Close()
	qi, err := insp.GetQueueInfo(r.queue)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.redisHeld = qi.Size
	r.redisStopped = time.Now()
	r.mu.Unlock()
	if err := r.s.redis.Stop(); err != nil {
		return err
	}
	r.event("stopped redis-server (SIGTERM; it saves on shutdown) with %s", fmtQueue(qi))
	if err := r.at(ctx, r.sl.lead+redisPrePause+r.sl.redisDown); err != nil {
		return err
	}
	if err := r.s.redis.Start(ctx); err != nil {
		return err
	}
	if err := r.s.redisPersistence(ctx); err != nil {
		return err
	}
	r.event("started redis-server again: %d keys loaded from its dump; %s", r.s.redisKeysLoaded(ctx), queueSize(insp, r.queue))
	if err := resumeAll(nodes); err != nil {
		return err
	}
	r.event("resumed replay on %s", names(nodes))
	return nil
}

// redisPrePause is how long replay is paused before Redis stops, while
// tasks pile up.
const redisPrePause = 1500 * time.Millisecond

func checkRedis(r *run, res *scenarioResult) {
	r.mu.Lock()
	held := r.redisHeld
	r.mu.Unlock()
	if held == 0 {
		r.fail("no task was waiting in Redis when it stopped: the restart did not put any job at risk")
	}
}

func queueSize(insp *asynq.Inspector, queue string) string {
	qi, err := insp.GetQueueInfo(queue)
	if err != nil {
		return fmt.Sprintf("queue unreadable (%v)", err)
	}
	return fmtQueue(qi)
}

func fmtQueue(qi *asynq.QueueInfo) string {
	return fmt.Sprintf("%d tasks in the queue (%d pending, %d active, %d scheduled, %d retry)", qi.Size, qi.Pending, qi.Active, qi.Scheduled, qi.Retry)
}

// churnState is what consumerChurn did to the Kafka group, and when.
type churnState struct {
	victim, second, third   *kafkaMember
	killAt, joinAt, leaveAt time.Time
}

func consumerChurn(ctx context.Context, r *run) error {
	c := r.sl.consumers
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	r.mu.Lock()
	old := r.srvs[0]
	r.srvs = r.srvs[1:]
	r.mu.Unlock()
	began := time.Now()
	old.Shutdown()
	r.event("asynq: Server.Shutdown mid-run took %s (tasks still running after ShutdownTimeout go back to the queue)", time.Since(began).Round(time.Millisecond))
	if _, err := r.startAsynqServer(); err != nil {
		return err
	}
	r.event("asynq: a new server started")

	if err := r.at(ctx, r.sl.lead+c); err != nil {
		return err
	}
	r.mu.Lock()
	victim := r.members[0]
	r.members = r.members[1:]
	r.mu.Unlock()
	killAt := time.Now()
	if err := victim.kill(); err != nil {
		return err
	}
	r.event("kafka: killed %s (connections reset, no final commit, no LeaveGroup)", victim.name)
	second, err := r.startKafkaMember("kafka-2")
	if err != nil {
		return err
	}
	r.event("kafka: kafka-2 joined the group; it gets kafka-1's partitions once kafka-1's session (%s) expires", r.s.group.session)

	if err := r.at(ctx, r.sl.lead+2*c); err != nil {
		return err
	}
	joinAt := time.Now()
	third, err := r.startKafkaMember("kafka-3")
	if err != nil {
		return err
	}
	r.event("kafka: kafka-3 joined: rebalance")

	if err := r.at(ctx, r.sl.lead+3*c); err != nil {
		return err
	}
	if _, err := r.startAsynqServer(); err != nil {
		return err
	}
	r.event("asynq: a second server started")

	if err := r.at(ctx, r.sl.lead+4*c); err != nil {
		return err
	}
	r.mu.Lock()
	for i, m := range r.members {
		if m == third {
			r.members = append(r.members[:i], r.members[i+1:]...)
			break
		}
	}
	r.mu.Unlock()
	leaveAt := time.Now()
	if err := third.stop(); err != nil {
		return err
	}
	r.event("kafka: kafka-3 left the group cleanly: rebalance")
	r.mu.Lock()
	r.state = &churnState{victim: victim, second: second, third: third, killAt: killAt, joinAt: joinAt, leaveAt: leaveAt}
	r.mu.Unlock()
	return nil
}

func checkChurn(r *run, res *scenarioResult) {
	for _, sr := range res.Streams[:2] {
		r.note("%s: %d runs for %d jobs (%d redelivered after the kills and rebalances)", sr.Stream, sr.Runs, sr.Jobs, sr.Runs-sr.Completed)
	}
	r.mu.Lock()
	st, _ := r.state.(*churnState)
	r.mu.Unlock()
	if st == nil {
		return // the fault failed and said so
	}
	// The coordinator's handovers, timed by what each member consumed.
	since := func(m *kafkaMember, t time.Time, parts map[int]bool) string {
		at, ok := m.firstAfter(t, parts)
		if !ok {
			return "never"
		}
		return at.Sub(t).Round(10 * time.Millisecond).String()
	}
	moved := st.third.partitionsBetween(st.joinAt, st.leaveAt)
	r.note("kafka group (session %s, rebalance timeout %s, heartbeats 300ms): %s killed -> %s's first message %s later; "+
		"%s joined -> its first message %s later; %s left (partitions %v) -> %s's first message of those %s later",
		r.s.group.session, r.s.group.rebalance, st.victim.name, st.second.name, since(st.second, st.killAt, nil),
		st.third.name, since(st.third, st.joinAt, nil), st.third.name, sortedKeys(moved), st.second.name, since(st.second, st.leaveAt, moved))
	if len(moved) == 0 {
		r.fail("%s consumed nothing while in the group: the join rebalance gave it no partitions", st.third.name)
	}
	if _, ok := st.second.firstAfter(st.killAt, nil); !ok {
		r.fail("%s consumed nothing after %s was killed: the coordinator never handed its partitions over", st.second.name, st.victim.name)
	}
}

func sortedKeys(m map[int]bool) []int {
	out := make([]int, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func replayConflict(ctx context.Context, r *run) error {
	primary := r.env.producer
	if _, err := primary.Exec(ctx, `CREATE TABLE conflict (id int PRIMARY KEY, pad text);
		INSERT INTO conflict SELECT g, repeat('x', 200) FROM generate_series(1, 2000) g`); err != nil {
		return err
	}
	if err := r.cluster.WaitReplicasCaughtUp(ctx); err != nil {
		return err
	}
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	nodes := r.env.replicaNodes
	holds := []time.Duration{r.sl.holdLong, r.sl.holdShort}
	releases := make([]func(), len(nodes))
	for i, n := range nodes {
		// Released by hand, counted from the VACUUM: that is when replay
		// starts waiting, however long the DELETE and VACUUM took.
		release, err := n.HoldQuery(ctx, r.env.name, 0)
		if err != nil {
			return err
		}
		defer release()
		releases[i] = release
	}
	mon := newReplayMonitor(ctx, nodes, r.env.name)
	defer mon.stop()
	if _, err := primary.Exec(ctx, `DELETE FROM conflict`); err != nil {
		return err
	}
	if _, err := primary.Exec(ctx, `VACUUM conflict`); err != nil {
		return err
	}
	vacuumed := time.Now()
	r.event("holding a snapshot on %s and %s; DELETE + VACUUM on the primary", nodes[0].Name(), nodes[1].Name())
	for _, i := range []int{1, 0} {
		if !sleepCtx(ctx, time.Until(vacuumed.Add(holds[i]))) {
			return ctx.Err()
		}
		releases[i]()
		r.event("hold on %s ended %s after the VACUUM", nodes[i].Name(), holds[i])
	}
	sleepCtx(ctx, time.Second)
	stalls := mon.stop()
	r.mu.Lock()
	r.stalls = stalls
	r.mu.Unlock()
	for i, n := range nodes {
		r.event("%s: longest replay stall %s", n.Name(), stalls[i].Round(100*time.Millisecond))
	}
	return nil
}

func checkConflict(r *run, res *scenarioResult) {
	r.mu.Lock()
	stalls := r.stalls
	r.mu.Unlock()
	if len(stalls) < 2 {
		return
	}
	// replica1's hold outlives max_standby_streaming_delay, so the server
	// cancels it and replay goes on: the stall is about that long.
	if want := r.sl.standbyDelay * 8 / 10; stalls[0] < want {
		r.fail("replica1's replay stalled only %s; the conflict did not happen (want about %s)", stalls[0], r.sl.standbyDelay)
	}
	if want := r.sl.holdShort * 7 / 10; stalls[1] < want {
		r.fail("replica2's replay stalled only %s; the conflict did not happen (want about %s)", stalls[1], r.sl.holdShort)
	}
	expectDeferrals(r, res)
}

// replayMonitor polls replicas' replay positions and measures the longest
// time each stood still while the primary kept writing.
type replayMonitor struct {
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
	stalls []time.Duration
}

func newReplayMonitor(ctx context.Context, nodes []*pgtest.Node, db string) *replayMonitor {
	ctx, cancel := context.WithCancel(ctx)
	m := &replayMonitor{cancel: cancel, done: make(chan struct{}), stalls: make([]time.Duration, len(nodes))}
	go func() {
		defer close(m.done)
		last := make([]string, len(nodes))
		since := make([]time.Time, len(nodes))
		for ctx.Err() == nil {
			for i, n := range nodes {
				lsn, err := n.ReplayLSN(ctx)
				if err != nil {
					continue
				}
				now := time.Now()
				if lsn != last[i] {
					last[i], since[i] = lsn, now
				} else if d := now.Sub(since[i]); d > m.stalls[i] {
					m.stalls[i] = d
				}
			}
			sleepCtx(ctx, 100*time.Millisecond)
		}
	}()
	return m
}

func (m *replayMonitor) stop() []time.Duration {
	m.once.Do(func() {
		m.cancel()
		<-m.done
	})
	return m.stalls
}

func capSpike(ctx context.Context, r *run) error {
	return pauseAllFor(ctx, r, r.sl.capPause, ": every job needs the primary")
}

// checkCap: every primary read of this scenario is a promotion the cap
// governs (all jobs carry tokens, sticky, and asynq tasks never reach the
// last attempt whose override would bypass it), so the limit applies to
// all primary reads, not only to those flagged as fallbacks.
func checkCap(r *run, res *scenarioResult) {
	all := checkPrimaryWindow(r, res)
	if all.Capped == 0 {
		r.fail("the cap never refused a job: the lag spike did not exercise it")
	}
}

// checkPrimaryWindow fails the scenario if more primary reads were decided
// in any window [t, t+1s) than the fallback cap admits (PrimaryRate x 1s +
// PrimaryBurst), for scenarios where every primary read is one the cap
// governs, and returns the totals row.
func checkPrimaryWindow(r *run, res *scenarioResult) streamResult {
	all := res.Streams[len(res.Streams)-1]
	if all.MaxPrimaryPerSec > res.CapWindowLimit {
		r.fail("%d primary reads within one second; the cap admits %d", all.MaxPrimaryPerSec, res.CapWindowLimit)
	}
	r.note("cap %g/s + burst %d: at most %d primary reads in any 1s window (decision time); highest seen %d; %d primary reads in all; %d refusals",
		res.CapRate, res.CapBurst, res.CapWindowLimit, all.MaxPrimaryPerSec, all.PrimaryRuns, all.Capped)
	return all
}
