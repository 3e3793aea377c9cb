// Package chaos runs caughtup through faults on real services and checks
// that no job reads stale data and none is lost; it also compares caughtup
// with two baseline policies and prints the capacity simulation.
//
// It is the program behind `go run ./chaos`, and `make chaos`:
//
//	go run ./chaos             # every scenario, 10,000 jobs each (make chaos)
//	go run ./chaos -short      # the same with fewer jobs and shorter faults
//	go run ./chaos -run 'wedge|cap' -json out.json -v
//
// Services, started together: one PostgreSQL 15 cluster (a primary and two
// streaming replicas, from testkit/pgtest), one redis-server and one real
// Apache Kafka 4.4 broker (single-node KRaft, from testkit/kafkatest; a
// few seconds to start, in parallel with PostgreSQL). With $KAFKA_BROKERS
// set (host:port,...) the Kafka pipelines use that cluster instead and no
// broker is started. Each scenario gets its own database, asynq queue,
// Kafka topic and consumer group, and one consume.Router shared by both
// pipelines, as one worker process would have; scenarios that promote a
// replica also get a cluster of their own.
//
// Kafka consumer groups: heartbeats every 300ms, a 3s session and a 6s
// rebalance timeout, so that a member killed without leaving is expired
// and its partitions handed over within seconds; the suite's broker lowers
// group.min.session.timeout.ms to 1s to accept that (Kafka's default
// minimum is 6s). Against $KAFKA_BROKERS, whose minimum the suite cannot
// change, sessions and rebalances are 10s, and the consumers scenario
// spaces its steps by at least half the session (a member that joins
// gets partitions only once the killed one has expired). No scenario
// needs the in-process kfake broker: the one Kafka fault, a member killed,
// is made by cutting the member's connections (testkit/fault's Dialer),
// which works the same against a real broker.
//
// Workload: eight producer goroutines each write a row in its own
// transaction (an upsert that bumps the row's version) with
// enqueue.InTx, and enqueue a job carrying the row and the version written,
// alternately through caughtup's stamping asynq client and its stamping
// kafka-go writer, so each scenario's jobs are split evenly between an
// asynq pipeline and a Kafka pipeline running concurrently (a scenario
// about asynq alone sends every job through asynq; replay-pause adds a
// third pipeline, a Kafka consumer in RetryTopic mode on a topic of its
// own, and splits the jobs three ways). Consumers are the adapters' own:
// an asynq server (250 workers, see asynqConcurrency) with
// caughtupasynq.ServerConfig and Middleware, whose Inspector wakes
// deferred tasks at their catch-up, and a caughtupkafka.Consumer (8
// partitions, in-place deferral; RetryTopic for the third pipeline) with
// caughtupkafka.Middleware. Some scenarios add the River and franz-go
// adapters' pipelines (adapters.go): River (caughtupriver's Middleware on a
// River client working River's schema, installed with rivermigrate in the
// scenario's database) in two lanes, jobs inserted after the commit with
// caughtupriver.Insert (the token in the job's metadata) and jobs inserted
// with River's InsertTx inside the write's transaction (no token: routed
// by the primary's position read after the fetch), and franz-go
// (caughtupkgo's Producer, and its Consumer waiting in place by pausing
// partitions) on a topic of its own; the jobs then alternate between every
// pipeline, each with its own stream (river, river-tx, kgo). The handler
// reads the row from consume.DB(ctx, "main").
//
// Checker and columns: every handler run is a read, recorded with where
// it ran and the version it saw.
//
//   - stale: the version read is lower than the one the job's producer
//     wrote, or the row is missing. The diverged-standby scenario refines
//     this for rows written on an old primary after a failover (below).
//   - lost: produced (the enqueue returned nil) and never completed (no
//     handler run returned nil) by the end of the drain; Kafka dead
//     letters count as lost. After a Redis outage the drain lasts until
//     asynq's recoverer has brought back the tasks whose state it could
//     not write (asynqLeaseRecovery); the run notes how many it retried,
//     and explains each job it gave up on (attempts, and where its task
//     is in Redis).
//   - replica share: handler runs that read a replica / all runs.
//   - primary fallbacks: runs the router promoted to the primary for lag
//     or unknown replica state (Decision.Fallback), what the cap limits.
//   - deferrals: attempts that did not run because no replica had caught
//     up (asynq: rescheduled without spending a retry; Kafka: slept in
//     place); capped: attempts the fallback cap refused.
//   - catch-up p50/p99 (the comparison's "added" latency): enqueue to the
//     handler's read, after routing, waits, deferrals and retries, of the
//     run that completed the job.
//   - max fallback/1s (cap): the most fallback reads whose decision time
//     (the token's capture time plus Decision.TokenAge, the router's own
//     clock) falls in any half-open window [t, t+1s), against
//     PrimaryRate x 1s + PrimaryBurst, the most a token bucket admits in
//     such a window.
//
// Catch-up -> handler start, a second table per scenario (catchup.go): a
// follower records every snapshot the scenario's router publishes. A job
// could not run at once if its token was not caught up in the snapshot
// current when it was enqueued; its latency runs from the first recorded
// snapshot after that in which its token is caught up (the Read of
// firstCaughtUp: the tracker had read an observation of a replica
// past the token) to the start of the handler run that completed it. Rows
// per pipeline: every such job, those enqueued while replay was paused on
// every replica (from the moment the last replica reported its replay
// paused to the resume request), and those routed more than once
// (deferred, or waiting in place again); p50, p99, max and mean over the
// jobs started after their catch-up, and counts of jobs started before it
// (the primary; on a replica only when the follower missed the snapshot
// of the catch-up, which it reports) and never seen caught up. A line per
// pipeline says how fast the paused jobs caught up and how fast the
// pipeline started them: after a long pause that throughput, not the
// wake, bounds the latency. The table also counts completing runs whose
// queue retry count (asynq.GetRetryCount, caughtupkafka.Attempt) was
// above 0, and those of them whose job had no failed attempt (a handler
// error, or for asynq a refusal by the fallback cap): a retry count grown
// by deferrals, which fails the run. Notes give the asynq wake's counters
// and the Kafka consumers' results by topic.
//
// Scenarios, each with its fault in the middle of production:
//
//   - replay-pause: replay paused on both replicas for 30s; asynq, Kafka
//     in place and Kafka retry topic. About 7,500 jobs wait through it and
//     catch up within about 100ms of the resume.
//   - replica-crash: each replica SIGKILLed and restarted in turn.
//   - failover: on a cluster of its own, replica1 is promoted (clean
//     switchover). The producers' and the router's primary pools use a
//     multi-host URL with target_session_attrs=read-write, so they follow
//     the primary to its new node (as a DNS name or proxy would) without a
//     rebuild; writes that fail during the switch are retried. The
//     router's tracker sees the new timeline and the promoted node leave
//     recovery, which excludes it as a replica; the other replica follows
//     the new timeline, and jobs written on timeline 1 must still read
//     their rows.
//   - tracker-wedge: the backends serving the tracker's replica query are
//     found in pg_stat_activity and SIGSTOPped (and any new one, until the
//     end). A stopped backend alone does not wedge the tracker: its query
//     times out, it reconnects and its new backend answers before it can be
//     found, so new connections to the replicas are also held by a fault
//     dialer (testkit/fault) that the replica pools dial through; the
//     handlers' connections were all opened beforehand. Once the last
//     observation is older than the staleness bound, no job may read a
//     replica until the wedge ends.
//   - redis-restart: redis-server stopped and started while deferred tasks
//     sit in asynq's retry set (replay is paused for a moment just
//     before); persistence is switched on at runtime because pgtest starts
//     redis-server without it.
//   - consumers: asynq Server.Shutdown mid-run and new servers; a Kafka
//     member killed (connections reset, no commit, no LeaveGroup), a
//     replacement, and a third member joining and leaving (rebalances).
//     A note times the coordinator's handovers from what each member
//     consumed (on the suite's broker: about 3s after the kill, the
//     session, and under a second for the join and the leave).
//   - replay-conflict: a snapshot held on each replica while the primary
//     deletes and vacuums rows it can see; replay stalls until
//     max_standby_streaming_delay cancels the query (replica1) or the hold
//     is released (replica2).
//   - lag-spike-cap: sticky policy with the fallback cap at 20/s, burst 20,
//     and replay paused on both replicas: at most 40 primary reads in any
//     window [t, t+1s). River and franz-go run beside asynq and Kafka: a
//     refusal fails a River attempt, which River retries, and holds a
//     franz-go record in place.
//   - diverged-standby: a failover whose old primary was not fenced, on a
//     cluster of its own with three replicas. The main producers and the
//     router's primary pool are moved to replica1 (their connections to
//     the old primary cut, and replica1 made to replay all it had), then
//     replica1 is promoted alone (pgtest's PromoteAlone): the old primary
//     keeps running and replica2 keeps following it; replica3 is re-pointed
//     at replica1. A split-brain client that still has the old primary's
//     address writes rows of its own there throughout (held only while
//     the router's tracker cannot yet know the new timeline), so replica2
//     replays past the switchpoint: a diverged standby. Then replica3 is
//     stopped for a while, leaving only the diverged standby. Stale, for
//     the split-brain rows: with nv the row's version on the new primary
//     at the end, a job that wrote version v must read min(v, nv); a
//     version above nv exists only in the lost history, so a job that reads
//     one has read a diverged server, and a job whose write was lost
//     (v > nv) must read exactly nv. Checks: no route to replica2 after the
//     tracker reported it diverged (routes in the detection moment before
//     are counted and reported), no new-timeline job waited while only
//     replica2 was left, jobs written on timeline 1 before the promotion
//     read their rows after it, and no main row changed on the old
//     primary after the switch (so the ordinary rule holds for them).
//   - timeout-tasks: asynq only; tasks with asynq.Timeout (2s or 30s; 2s or
//     4s in the short run) and no Deadline, delayed policy, replay paused
//     on both replicas for 45s (6s), fallback cap 5/s, burst 5. The lag
//     grows until deferrals outlast an attempt's Timeout (delay + 2s of
//     slack beyond the attempt's deadline), where the middleware must tell
//     a Timeout (per attempt) from a Deadline (absolute) and keep
//     deferring. Checks: deferrals past the deadline happened for both
//     Timeout values, caughtup.asynq.overrides counted nothing, primary
//     reads in any window [t, t+1s) stay within 10, and every task
//     completes once replay resumes.
//   - feed-publisher-kill, feed-publishers-stopped, feed-redis-restart,
//     feed-publisher-sigstop, feed-failover (feedscenarios.go): the
//     router takes positions from a signed position feed of two
//     publishers, each a `caughtup feed` process (the binary -caughtup
//     names, else one built with go build), while random replay pauses
//     come and go; then one publisher is SIGKILLed (the other keeps the
//     feed going), both are stopped (the router falls back to its own
//     polls, counted, and returns when they restart), redis-server is
//     restarted, publishers are frozen with SIGSTOP for 1-7s (their
//     polls arrive late, some past the staleness bound and MaxDelay), or
//     a replica is promoted. Checks besides stale and lost: the fault
//     took effect (no message from the killed publisher, late messages
//     seen, the fallback and the return counted), jobs waited or were
//     deferred, and the router is back on the feed at the end.
//   - forged-feed (forged.go): replay paused on both replicas for 15s
//     (4s), during which 1,200 (240) messages claiming both replicas
//     caught up are published on the feed's channel with a plain Redis
//     client: 12 kinds (wrong secret, another feed's MAC, unknown key
//     ID, unsigned, malformed, format version 2, authentic ones replayed,
//     and, signed with the real key, impossible, of an earlier run, sent a
//     minute ago, of an unknown node, of another system). Each must be
//     rejected under the counter its kind calls for, and the rejections
//     must equal the injections.
//   - balanced (balanced.go): the router's one replica pool is an HAProxy
//     (testkit/proxytest) balancing connections round robin over both
//     standbys, while replay pauses on one standby at a time, at random,
//     for up to 5s (3s). The tracker watches one standby, the handlers'
//     connections reach either; consume checks each routed acquire against
//     the server the decision judged, and a job whose connections keep
//     reaching the paused standby fails without reading and is retried.
//     Checks besides stale and lost: replay was paused, and some routed
//     connection reached the standby the tracker does not watch; a note
//     gives the connection checks by result.
//   - weighted-balancer (weighted.go): the router's one replica pool is a
//     PgBouncer in transaction pooling (pgx simple protocol) whose one
//     database entry is an HAProxy over both standbys weighted 9:1, as
//     issue 36 found a start-up sample fooled by; replay pauses at random
//     on the lightly weighted standby (up to 5s; 3s), and four other
//     clients run short transactions through the same PgBouncer database.
//     PgBouncer keeps its pool full and renews server connections every
//     250ms, so that about one in ten reaches the light standby
//     throughout. Checks besides stale and lost: every routed read was
//     checked in its transaction (none admitted as a direct connection),
//     some found the paused standby and were given back, and HAProxy sent
//     server connections to the light standby. The kafka-go Consumers
//     route by themselves (scenario.kafkaRoutes).
//   - unreachable-replica (unreachable.go): replica1's new handler
//     connections are reset by a testkit/fault proxy for 60s (4s), its
//     live ones cut, while the tracker reaches it directly and calls it
//     healthy; replica2's replay is paused for a quarter of that at its
//     start and again halfway. Every pipeline at once, the kafka-go
//     Consumers routing by themselves. Checks besides stale and lost: no
//     job dead-lettered or completed with a retry count above 0 (a
//     replica's failure spends no attempt), the router left replica1 out
//     as unreachable while the tracker called it usable, and jobs waited
//     or were deferred.
//   - adapters (adapters.go): every pipeline at once (asynq, Kafka in
//     place and retry topic, river, river-tx, kgo, a sixth of the jobs
//     each) while replay pauses at random on one replica or both (up to
//     1.5s; 800ms) and each replica is SIGKILLed and restarted in turn;
//     meanwhile a franz-go member is killed (connections cut and refused:
//     no commit, no LeaveGroup), a replacement joins and later a third
//     (rebalance). Checks besides stale and lost: the tracker saw each
//     crash, River routed by metadata tokens and by positions after the
//     fetch, jobs waited or were deferred, and every franz-go member
//     completed records.
//   - adapters-pause (adapters.go): every pipeline through replay-pause's
//     pause (30s; 3s): River's jobs are snoozed again and again, franz-go's
//     partitions paused. Every pipeline must have deferred jobs.
//
// The River pipeline counts each attempt in a worker middleware outside
// caughtup's, as the other pipelines' wrappers do (a snooze is a
// deferral). franz-go's Consumer routes before its handler and holds a
// record that must wait, which the handler never sees: its stream's
// deferrals are the consumer's caughtup.kafka.messages waited (the cap's
// refusals among them, so its capped column stays 0), and its routed more
// than once row counts handler runs only (redeliveries, runs after a
// handler error). The decision time
// of a River job inserted with InsertTx, for the fallback cap's windows,
// is its CreatedAt plus the decision's TokenAge (the middleware dates the
// position after the fetch at the job's insert).
//
// A new scenario goes in a file of its own (diverged.go and timeouts.go
// are examples): a constructor returning a *scenario, named on its own
// line in scenarioList, which sets the running order.
//
// Then a comparison: one workload consumed by caughtup and by two
// baselines implemented here, a GitLab-style check (live replay query per
// replica, 3 sleeps of 0.5s, one retry through the queue, then the primary)
// and a 2s time window, under random replay pauses. Besides enqueue ->
// read, it reports catch-up -> handler start on the jobs enqueued while
// every replica was paused whose token no replica had replayed then (from
// the caughtup router's snapshots, the same catch-up for every policy),
// with means, and the GitLab-style mean over caughtup's; jobs a policy ran
// before their catch-up (the primary, or the time window's stale reads)
// are counted apart and, in a second mean, as 0.
//
// The fleet simulation (`make fleet`, FleetMain in fleet.go) is a program
// of its own: many routers in worker processes, on the feed or polling,
// and what they cost the replicas and Redis.
//
// The run exits 1 if caughtup read stale data, lost a job, let more
// primary reads through than the cap admits, or completed a job with a
// retry count no failed attempt explains, or if a fault did not take
// effect. Baselines' stale reads are the point of the comparison and do
// not fail it.
package lab

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"regexp"
	"time"
)

// Main runs the suite with command-line args (without the program name),
// printing tables to stdout and progress to stderr, and returns the exit
// status: 0 when every check held, 1 when one did not, 2 for bad flags.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	fs.SetOutput(stdout)
	fs.Usage = func() {
		fmt.Fprintln(stdout, "usage: go run ./chaos [-short] [-run REGEXP] [-jobs N] [-json FILE] [-v] [-capacity]\n\nRuns caughtup through faults on real services (replay pause, replica crash,\nfailover, tracker wedge, Redis restart, consumer kills and rebalances, replay\nconflict, lag spike under the fallback cap, diverged standby, Timeout tasks\nunder a long lag, and with the router on a position feed: a publisher killed,\nall stopped, Redis restarted, publishers frozen, a failover, forged messages;\nand with the replicas behind a balancer, or PgBouncer over a weighted one;\na replica the handlers cannot reach; and the River and franz-go\nadapters beside asynq and Kafka),\ncompares it with GitLab-style and time-window policies,\nprints a table per scenario and exits 1 on any stale read or lost job.\n\nKAFKA_BROKERS=host:port,... runs the Kafka pipelines on that cluster instead\nof the broker the suite starts.")
		fs.PrintDefaults()
	}
	short := fs.Bool("short", false, "fewer jobs and shorter faults (at most 3 minutes)")
	jsonPath := fs.String("json", "chaos-results.json", "write the results as JSON to this file")
	verbose := fs.Bool("v", false, "log the services' warnings (caughtup, asynq, kafka) to stderr")
	capacityOnly := fs.Bool("capacity", false, "run only the capacity simulation")
	jobs := fs.Int("jobs", 0, "jobs per scenario and in the comparison instead of the run's default (10,000, -short 800): a diagnostic, e.g. of how the catch-up -> start latency grows with the burst a replay pause leaves")
	only := fs.String("run", "", "run only the scenarios whose name matches this regular expression (\"compare\" is the comparison)")
	caughtupBin := fs.String("caughtup", "", "the caughtup binary the feed scenarios run their publishers with (caughtup feed); default: built from this module with go build")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}

	rows := simulateCapacity(defaultReadDelays, capacityLags)
	printCapacity(stdout, rows)
	if *capacityOnly {
		return 0
	}
	o := options{short: *short, scale: fullScale, caughtupBin: *caughtupBin}
	if o.short {
		o.scale = shortScale
	}
	if *jobs > 0 {
		o.scale.jobs = *jobs
	}
	if *only != "" {
		re, err := regexp.Compile(*only)
		if err != nil {
			fmt.Fprintf(stderr, "chaos: -run: %v\n", err)
			return 2
		}
		o.only = re
	}
	var logw io.Writer = io.Discard
	if *verbose {
		logw = stderr
	}
	out := &progress{start: time.Now(), w: func(s string) { fmt.Fprintln(stderr, s) }}
	res := runSuite(ctx, o, out, logw, stdout)
	res.Capacity = rows
	path, err := filepath.Abs(*jsonPath)
	if err != nil {
		path = *jsonPath
	}
	if err := writeJSON(path, res); err != nil {
		fmt.Fprintf(stderr, "chaos: writing %s: %v\n", path, err)
		return 1
	}
	fmt.Fprintf(stdout, "\nresults written to %s\n", path)
	if len(res.Failures) > 0 {
		return 1
	}
	return 0
}

// runSuite starts the services, runs every selected scenario and the
// comparison, printing each table as it finishes.
func runSuite(ctx context.Context, o options, out *progress, logw, w io.Writer) *suiteResult {
	began := time.Now()
	res := &suiteResult{Mode: "full", Interpretation: interpretation, Started: began.Format(time.RFC3339)}
	if o.short {
		res.Mode = "short"
	}
	defer func() {
		res.Seconds = time.Since(began).Seconds()
		res.collectFailures()
		printSummary(w, res)
	}()
	s, err := startServices(ctx, o, out, logw)
	if err != nil {
		res.Scenarios = append(res.Scenarios, scenarioResult{Name: "services", Failures: []string{err.Error()}})
		return res
	}
	defer s.close()
	res.Kafka = s.kafkaName()
	fmt.Fprintf(w, "\nchaos (%s): %s\nKafka: %s\n", res.Mode, interpretation, res.Kafka)
	for _, sc := range scenarios(s.opts.scale) {
		if o.only != nil && !o.only.MatchString(sc.name) {
			continue
		}
		r := runScenario(ctx, s, sc)
		printScenario(w, r)
		res.Scenarios = append(res.Scenarios, r)
	}
	if o.only == nil || o.only.MatchString("compare") {
		c := runComparison(ctx, s)
		printComparison(w, &c)
		res.Comparison = &c
	}
	return res
}
