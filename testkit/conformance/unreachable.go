package conformance

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Unreachable is the scenario of a replica that stays out of this
// process's reach while the tracker calls it healthy: the router reaches
// replica 1 through a proxy that, once the tracker's own connection is up,
// resets every new connection for Config.UnreachableFor, and the tracker's
// connection, made before, keeps reporting replica 1 caught up. Replica
// 2's replay is paused for its first seconds and again halfway, so that
// for a while the one replica the tracker calls caught up is the one the
// handlers cannot reach. Jobs are produced throughout.
//
// Every job must be handled, none stale, none set aside by the queue, and
// no replica failure may cost a job an attempt: a handler read that failed
// because the router's replica failed it (consume.ReplicaFailed) is
// routed again by the adapter without counting, so a retry count that
// grew (RetryCounter) fails the scenario. Report.Failed counts those
// failed reads.
//
// The driver must implement DeadLetterCounter.
func Unreachable(t *testing.T, cfg Config) Report {
	cfg = cfg.withDefaults()
	d := cfg.NewDriver(t)
	if _, ok := d.(DeadLetterCounter); !ok {
		t.Fatalf("conformance: the unreachable-replica scenario checks the queue's dead letters; %T does not implement DeadLetterCounter", d)
	}
	c := pgtest.Shared(t)
	replicas := c.Replicas()
	require.GreaterOrEqual(t, len(replicas), 2, "the scenario needs two standbys")
	proxy, err := fault.NewProxy(net.JoinHostPort("127.0.0.1", strconv.Itoa(replicas[0].Port())))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	e := setupWith(t, cfg, func(db string) []replay.Replica {
		far, err := pgxpool.New(t.Context(), fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", proxy.Addr(), db))
		require.NoError(t, err)
		t.Cleanup(far.Close)
		near, err := replicas[1].Pool(t.Context(), db)
		require.NoError(t, err)
		return []replay.Replica{{Name: "unreachable", Pool: far}, {Name: "reachable", Pool: near}}
	})
	// The tracker's connection to replica 1 is up (it has observed it):
	// from now on only new connections are reset.
	deadline := time.Now().Add(time.Minute)
	for {
		if st := e.router.Snapshot().Database("main").Replicas[0]; st.Observations > 0 && st.Err == nil {
			break
		}
		require.True(t, time.Now().Before(deadline), "the tracker never observed replica 1 through the proxy")
		time.Sleep(10 * time.Millisecond)
	}
	proxy.Refuse()
	refused := time.Now()

	lag := func(ctx context.Context) {
		second := replicas[1]
		bg := context.Background() // resume even as ctx ends
		for _, spell := range []struct{ at, length time.Duration }{
			{0, unreachablePause},
			{cfg.UnreachableFor / 2, unreachablePause},
		} {
			sleepOrDone(ctx, time.Until(refused.Add(spell.at)))
			if ctx.Err() != nil {
				break
			}
			if err := second.PauseReplay(bg); err != nil {
				t.Errorf("conformance: pause %s: %v", second.Name(), err)
			}
			sleepOrDone(ctx, spell.length)
			if err := second.ResumeReplay(bg); err != nil {
				t.Errorf("conformance: resume %s: %v", second.Name(), err)
			}
		}
		// Production ends with the window.
		sleepOrDone(ctx, time.Until(refused.Add(cfg.UnreachableFor)))
	}
	perSecond := rate.Limit(float64(cfg.UnreachableJobs) / cfg.UnreachableFor.Seconds())
	var trackerHealthy atomic.Bool
	rep := routed(t, cfg, e, d, cfg.UnreachableJobs, perSecond, func(ctx context.Context) {
		lag(ctx)
		// Sampled before the proxy accepts again: the tracker's own
		// connection still calls replica 1 healthy.
		st := e.router.Tracker().Snapshot().Database("main").Replicas[0]
		trackerHealthy.Store(st.Err == nil && st.Usable(time.Now().Add(-e.router.Config().Tracker.StalenessBound)))
	})
	rep.Scenario = "UnreachableReplica"
	require.True(t, trackerHealthy.Load(), "the tracker stopped calling replica 1 healthy: the scenario did not test what it means to")
	// Either a handler met the refusal (and was routed again) or the
	// router found it first (a probe, a connection of its own): in both
	// cases the replica was left out while its tracker state said healthy.
	excluded := metrictest.Sum(t, e.reader, "caughtup.consume.replica.exclusions", attribute.String("caughtup.replica", "unreachable"))
	t.Logf("%s: replica 1 excluded %d times, %d handler runs failed by it and routed again", t.Name(), excluded, rep.ReplicaFailed)
	require.Positive(t, excluded, "the router never found replica 1 unreachable")
	proxy.Accept()
	accepted, _, _ := proxy.Stats()
	t.Logf("%s: %d connections to replica 1 asked of the proxy in all", t.Name(), accepted)
	return rep
}

// unreachablePause is how long each pause of replica 2 lasts in the
// unreachable scenario: several wait budgets, so that jobs are deferred.
const unreachablePause = 5 * time.Second

// ReplicaFailsRun is the unreachable replica met by the handler itself,
// which Unreachable rarely shows: there the router's own probes usually
// find the refusal before any handler is routed to the replica. The
// router's one replica pool reaches replica 1 through a proxy that resets
// every new connection from the start, while the tracker's connections
// (named replay.ApplicationName) reach it directly and call it caught up.
// The jobs' rows are written and seen replayed there by the tracker
// before the jobs are produced, so that each is routed to replica 1 at
// once (no wait, so no probe): the first handler reads fail because the replica
// cannot be reached (consume.ReplicaFailed), and the adapter must route
// those jobs again, which the router then sends elsewhere (the replica is
// left out), without counting an attempt.
//
// Every job must be handled, none stale, none set aside by the queue, no
// retry count may grow, and at least one handler read must have failed by
// the replica (Report.ReplicaFailed).
//
// The driver must implement RetryCounter and DeadLetterCounter.
func ReplicaFailsRun(t *testing.T, cfg Config) Report {
	cfg = cfg.withDefaults()
	d := cfg.NewDriver(t)
	_, counts := d.(RetryCounter)
	_, dead := d.(DeadLetterCounter)
	if !counts || !dead {
		t.Fatalf("conformance: the replica-fails-run scenario checks attempts and dead letters; %T must implement RetryCounter and DeadLetterCounter", d)
	}
	c := pgtest.Shared(t)
	r1 := c.Replicas()[0]
	proxy, err := fault.NewProxy(net.JoinHostPort("127.0.0.1", strconv.Itoa(r1.Port())))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	proxy.Refuse()
	e := setupWith(t, cfg, func(db string) []replay.Replica {
		pc, err := pgxpool.ParseConfig(fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", proxy.Addr(), db))
		require.NoError(t, err)
		port := uint16(r1.Port())
		pc.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
			if cc.RuntimeParams["application_name"] == replay.ApplicationName {
				cc.Host, cc.Port = "127.0.0.1", port // the tracker goes around the proxy
			}
			return nil
		}
		far, err := pgxpool.NewWithConfig(t.Context(), pc)
		require.NoError(t, err)
		t.Cleanup(far.Close)
		return []replay.Replica{{Name: "unreachable", Pool: far}}
	})
	ctx := t.Context()
	const jobs = 4
	written := make([]context.Context, jobs)
	for i := range written {
		written[i], err = e.write(ctx, int64(i+1))
		require.NoError(t, err)
	}
	last, _ := enqueue.TokenFrom(written[jobs-1])
	require.NotEmpty(t, last.Entries)
	require.Eventually(t, func() bool {
		st := e.router.Snapshot().Database("main").Replicas[0]
		return st.Usable(time.Now().Add(-e.router.Config().Tracker.StalenessBound)) && st.Replayed.LSN >= last.Entries[0].LSN
	}, time.Minute, 10*time.Millisecond, "the tracker never saw replica 1 replay the jobs' tokens")

	chk := newChecker(jobs)
	start := time.Now()
	stop, err := d.Consume(ctx, e.router, consume.Delayed, chk.handler(d))
	require.NoError(t, err)
	for i, pctx := range written {
		id := int64(i + 1)
		require.NoError(t, d.Produce(pctx, Job{ID: id, Key: fmt.Sprintf("k%d", id)}))
	}
	completed := chk.wait(2 * time.Minute)
	require.NoError(t, stop())
	rep := Report{Scenario: "ReplicaFailsRunRoutedAgain", Jobs: jobs, Elapsed: time.Since(start)}
	rep.DeadLettered, err = d.(DeadLetterCounter).DeadLettered(ctx)
	require.NoError(t, err)
	excluded := metrictest.Sum(t, e.reader, "caughtup.consume.replica.exclusions", attribute.String("caughtup.replica", "unreachable"))
	chk.mu.Lock()
	defer chk.mu.Unlock()
	rep.Stale, rep.Retried, rep.Failed, rep.ReplicaFailed = len(chk.stale), chk.retried.Load(), chk.failedRuns, chk.replicaFailedRuns
	for id := int64(1); id <= jobs; id++ {
		rep.Runs += chk.runs[id]
		if chk.runs[id] == 0 {
			rep.Lost++
		}
	}
	for o, n := range chk.outcomes {
		if o == consume.OutcomeReplica || o == consume.OutcomeReplicaWaited {
			rep.ReplicaRuns += n
		} else {
			rep.PrimaryRuns += n
		}
	}
	t.Logf("%s: %s outcomes=%v primary reasons=%v; replica 1 excluded %d times", t.Name(), rep, chk.outcomes, chk.reasons, excluded)
	require.Empty(t, chk.stale)
	require.True(t, completed, "not every job completed: %d of %d", chk.finished, jobs)
	require.Zero(t, rep.Lost, "lost jobs")
	require.Positive(t, rep.ReplicaFailed, "no handler read failed by the replica: the adapter's routing again was not exercised")
	require.Zero(t, rep.Failed, "a handler read failed for another reason")
	require.Zero(t, rep.Retried, "a replica's failure counted as a failed attempt")
	require.Zero(t, rep.DeadLettered, "jobs the queue set aside")
	require.Positive(t, excluded, "the router never left replica 1 out")
	return rep
}
