package lab

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
)

// comparisonResult is caughtup and the two baselines on one workload.
type comparisonResult struct {
	About         string         `json:"about"`
	Jobs          int            `json:"jobs"`
	Split         string         `json:"split"`
	Streams       []streamResult `json:"streams"`
	Totals        []streamResult `json:"totals"`
	Pauses        int            `json:"replay_pauses"`
	PausedSeconds float64        `json:"paused_replica_seconds"`
	// AllPaused counts the pauses of every replica at once and
	// AllPausedSeconds their length: the jobs enqueued during them
	// (streamResult.Paused) are the ones the catch-up → start comparison
	// is made on.
	AllPaused        int     `json:"pauses_of_every_replica"`
	AllPausedSeconds float64 `json:"every_replica_paused_s"`
	// MeanRatio is the GitLab-style baseline's mean catch-up → start on
	// those jobs over caughtup's (every pipeline), MeanRatioEarlyZero the
	// same with the jobs a policy ran before their catch-up counted as 0.
	MeanRatio          float64 `json:"gitlab_over_caughtup_mean_catch_up_to_start"`
	MeanRatioEarlyZero float64 `json:"gitlab_over_caughtup_mean_catch_up_to_start_early_as_0"`
	// Drain is caughtup's largest burst beside plain asynq's drain of as
	// many tasks; nil when no job was enqueued while every replica was
	// paused.
	Drain             *drainComparison `json:"drain,omitempty"`
	SnapshotsRecorded int              `json:"snapshots_recorded"`
	SnapshotsSkipped  uint64           `json:"snapshots_skipped"`
	ProduceSeconds    float64          `json:"production_s"`
	Seconds           float64          `json:"elapsed_s"`
	Failures          []string         `json:"failures,omitempty"`
}

// compareDelay is when jobs are enqueued after their write: most at once,
// some scheduled for later or relayed late. A job's age when it runs is
// what the time window routes on, so without older jobs the window would
// send everything to the primary and have nothing to show.
func compareDelay(r *rand.Rand) time.Duration {
	switch u := r.Float64(); {
	case u < 0.5:
		return 0
	case u < 0.7:
		return time.Duration(r.Int64N(int64(time.Second)))
	case u < 0.9:
		return time.Second + time.Duration(r.Int64N(int64(2*time.Second)))
	default:
		return 3*time.Second + time.Duration(r.Int64N(int64(3*time.Second)))
	}
}

// runComparison produces one workload and consumes every job three times,
// once per policy: three asynq queues fed by the same producer, three
// consumer groups on one Kafka topic, and three River queues (a client
// each). Replay pauses at random on one or
// both replicas throughout, so that replicas are seconds behind at times.
func runComparison(ctx context.Context, s *services) (res comparisonResult) {
	sl := s.opts.scale
	began := time.Now()
	defer func() { res.Seconds = time.Since(began).Seconds() }()
	res.About = fmt.Sprintf("one workload, every job consumed by caughtup (delayed), GitLab-style (live check, 3 x 0.5s, one retry, primary) "+
		"and a 2s time window; replay paused at random (up to %s, one or both replicas); half the jobs enqueued 0-6s after their write", sl.maxPause)
	env, err := newDBEnv(ctx, s, s.cluster, "compare", consume.Config{DefaultPolicy: consume.Delayed}, false)
	if err != nil {
		res.Failures = append(res.Failures, fmt.Sprintf("set up: %v", err))
		return res
	}
	defer env.close()
	var reps []namedPool
	for _, rp := range env.replicas {
		reps = append(reps, namedPool{rp.Name, rp.Pool})
	}
	baselines := []baseline{
		&gitlab{primary: env.primary, replicas: reps, sleep: 500 * time.Millisecond, tries: 3},
		&window{primary: env.primary, replicas: reps, for_: 2 * time.Second},
	}
	policies := []string{"caughtup", "gitlab", "window"}

	base := s.name("compare")
	client := asynq.NewClient(s.redisOpt())
	defer client.Close()
	// Closed after the servers (stop, deferred later).
	inspector := asynq.NewInspector(s.redisOpt())
	defer inspector.Close()
	stamping := caughtupasynq.NewClient(client)
	if err := s.createTopics(ctx, 8, base); err != nil {
		res.Failures = append(res.Failures, err.Error())
		return res
	}
	kp := s.newKafkaPipe(base)
	defer kp.close()
	rc, err := s.startRiverCompare(ctx, env, base, policies, baselines)
	defer func() {
		if err := rc.stop(); err != nil {
			res.Failures = append(res.Failures, "river: "+err.Error())
		}
	}()
	if err != nil {
		res.Failures = append(res.Failures, fmt.Sprintf("start River consumers: %v", err))
		return res
	}

	var (
		ast, kst []*stream
		srvs     []*asynq.Server
		members  []*kafkaMember
	)
	stop := func() {
		var wg sync.WaitGroup
		for _, srv := range srvs {
			wg.Go(srv.Shutdown)
		}
		for _, m := range members {
			wg.Go(func() { _ = m.stop() })
		}
		wg.Go(func() {
			if err := rc.stop(); err != nil {
				res.Failures = append(res.Failures, "river: "+err.Error())
			}
		})
		wg.Wait()
		srvs, members = nil, nil
	}
	defer stop()
	asynqLane := &lane{name: "asynq"}
	kafkaSink := sink{send: kp.send}
	for i, pol := range policies {
		a := newStream("asynq/"+pol, "asynq", pol)
		k := newStream("kafka/"+pol, "kafka", pol)
		ast, kst = append(ast, a), append(kst, k)
		queue := base + "-" + pol
		pipe := &asynqPipe{queue: queue, client: stamping, maxRetry: 1000}
		asynqLane.sinks = append(asynqLane.sinks, sink{send: pipe.send, streams: []*stream{a}})
		kafkaSink.streams = append(kafkaSink.streams, k)
		group := base + "-" + pol
		var (
			srv *asynq.Server
			m   *kafkaMember
			err error
		)
		if i == 0 {
			srv, err = s.startCaughtupAsynq(queue, env.router, consume.Delayed, a, nil, inspector)
			if err == nil {
				m, err = s.startKafkaMember("kafka-"+pol, base, group, k, kafkaTuning{retryInitial: 100 * time.Millisecond, retryMax: time.Second},
					env.router, caughtupKafkaHandler(env.router, consume.Delayed, k), nil)
			}
		} else {
			b := baselines[i-1]
			// GitLab's retry through the queue comes back after 1s, the
			// delay of caughtup's first deferral, on the same queue.
			srv, err = s.startBaselineAsynq(queue, b, a, time.Second)
			if err == nil {
				m, err = s.startKafkaMember("kafka-"+pol, base, group, k, kafkaTuning{retryInitial: time.Second, retryMax: time.Second}, env.router, baselineKafkaHandler(b, k), nil)
			}
		}
		if srv != nil {
			srvs = append(srvs, srv)
		}
		if m != nil {
			members = append(members, m)
		}
		if err != nil {
			res.Failures = append(res.Failures, fmt.Sprintf("start %s consumers: %v", pol, err))
			return res
		}
	}
	w := &workload{
		pool: env.producer, jobs: sl.jobs, over: sl.compareFor, workers: 8, keys: int64(max(sl.jobs/4, 50)),
		lanes: []*lane{asynqLane, {name: "kafka", sinks: []sink{kafkaSink}}, {name: "river", sinks: rc.sinks(base, policies)}},
		delay: compareDelay,
	}
	s.out.say("compare: %s", res.About)
	s.out.say("compare: producing %d jobs over %s, each consumed by all three policies", sl.jobs, sl.compareFor)
	cctx, cancel := context.WithTimeout(ctx, sl.compareFor+sl.drain+2*time.Minute)
	defer cancel()
	pctx, stopPauses := context.WithCancel(cctx)
	var (
		pw        sync.WaitGroup
		allPaused []pauseSpan
	)
	nodes := env.replicaNodes
	pw.Go(func() {
		defer resumeAll(nodes)
		rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
		sleepCtx(pctx, sl.lead/2)
		for pctx.Err() == nil {
			paused := nodes
			if rng.IntN(3) != 0 {
				paused = nodes[rng.IntN(len(nodes)):][:1]
			}
			if err := pauseAll(pctx, paused); err != nil {
				break
			}
			from := time.Now()
			d := sl.maxPause/4 + time.Duration(rng.Int64N(int64(sl.maxPause*3/4)))
			sleepCtx(pctx, d)
			if len(paused) == len(nodes) {
				allPaused = append(allPaused, pauseSpan{from: from, to: time.Now()})
				res.AllPaused++
				res.AllPausedSeconds += time.Since(from).Seconds()
			}
			_ = resumeAll(paused)
			res.Pauses++
			res.PausedSeconds += d.Seconds() * float64(len(paused))
			sleepCtx(pctx, time.Duration(rng.Int64N(int64(time.Second))))
		}
	})
	follower := followSnapshots(env.router)
	defer follower.stop()
	start := time.Now()
	w.run(cctx)
	res.ProduceSeconds = time.Since(start).Seconds()
	stopPauses()
	pw.Wait()
	s.out.say("compare: production done (%d jobs in %.1fs), %d replay pauses", w.produced.Load(), res.ProduceSeconds, res.Pauses)

	// Wait for every policy to finish every job.
	all := append(append(append([]*stream{}, ast...), kst...), rc.streams...)
	deadline := time.Now().Add(sl.drain)
	for {
		left := 0
		for _, st := range all {
			left += st.pending()
		}
		if left == 0 || time.Now().After(deadline) || cctx.Err() != nil {
			if left > 0 {
				s.out.say("compare: gave up waiting for %d jobs", left)
			}
			break
		}
		sleepCtx(cctx, 100*time.Millisecond)
	}
	follower.stop()
	stop()
	res.Jobs = int(w.produced.Load())
	res.Split = fmt.Sprintf("%d asynq + %d kafka + %d river, concurrently; each consumed by 3 policies", w.lanes[0].jobs.Load(), w.lanes[1].jobs.Load(), w.lanes[2].jobs.Load())
	rcfg := env.router.Config()
	measure := func(st *stream) streamResult {
		sr := st.result()
		measureCatchUp(&sr, st, follower, &rcfg, allPaused)
		return sr
	}
	for i, pol := range policies {
		ar, kr, rr := measure(ast[i]), measure(kst[i]), measure(rc.streams[i])
		res.Streams = append(res.Streams, ar, kr, rr)
		tot := measure(mergeStreams(pol, pol, ast[i], kst[i], rc.streams[i]))
		res.Totals = append(res.Totals, tot)
		for _, sr := range []streamResult{ar, kr, rr} {
			if sr.Lost > 0 {
				// A baseline that loses jobs would make the comparison
				// meaningless; for caughtup it is a failure of the run.
				res.Failures = append(res.Failures, fmt.Sprintf("%s: %d of %d jobs never completed", sr.Stream, sr.Lost, sr.Jobs))
			}
			if pol == "caughtup" && sr.Stale > 0 {
				res.Failures = append(res.Failures, fmt.Sprintf("%s: %d stale reads, e.g. %v", sr.Stream, sr.Stale, sr.StaleExamples))
			}
		}
	}
	// The drain beside the means: caughtup's largest burst against plain
	// asynq starting as many pending tasks, now, on the same machine.
	d := &drainComparison{Caughtup: largestBurst(ast[0].catchUps(follower, &rcfg), allPaused)}
	for _, sr := range res.Streams {
		if sr.Stream == "asynq/gitlab" {
			d.GitLabMean = sr.Paused.Mean
		}
	}
	if d.Caughtup.Jobs > 0 {
		if bare, err := bareAsynqDrain(ctx, s, d.Caughtup.Jobs); err != nil {
			d.Error = err.Error()
		} else {
			d.Bare = bare
			if d.Caughtup.Span > 0 {
				d.Ratio = bare.Span / d.Caughtup.Span
			}
			if bare.MeanStart > 0 {
				d.Ceiling = d.GitLabMean / bare.MeanStart
			}
		}
		res.Drain = d
	}
	res.SnapshotsRecorded, res.SnapshotsSkipped = len(follower.snaps), follower.skipped
	follower.snaps = nil
	if c, g := res.Totals[0].Paused, res.Totals[1].Paused; c.N > 0 && c.Mean > 0 {
		res.MeanRatio = g.Mean / c.Mean
		if c.MeanEarlyZero > 0 {
			res.MeanRatioEarlyZero = g.MeanEarlyZero / c.MeanEarlyZero
		}
	}
	if res.Jobs < sl.jobs {
		res.Failures = append(res.Failures, fmt.Sprintf("only %d of %d jobs were produced", res.Jobs, sl.jobs))
	}
	return res
}
