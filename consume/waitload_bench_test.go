package consume

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/latency"
)

// BenchmarkWaitLoad measures what waiting jobs cost a replica and how soon
// they learn that it caught up, at WaitPollInterval 1ms (the old default)
// and 5ms (the default: at most 200 queries/s per awaited replica per
// process), with 1 and with 50 jobs waiting on one replica. It prints a
// table and asserts nothing about time.
//
//   - replica queries/s: the tracker's replica queries counted by the
//     replica itself (pg_stat_statements) during a 10 s replay pause with
//     the jobs waiting;
//   - catch-up → wait returns: per job, from the moment a probe looping on
//     its own connection first saw pg_last_wal_replay_lsn() pass the job's
//     token (midpoint of that query) to Route's return; samples from the
//     10 s pause and from short pauses (100 for 1 job, 10 × 50 jobs).
//
// Run it alone: go test -run '^$' -bench WaitLoad -benchtime 1x ./consume/
func BenchmarkWaitLoad(b *testing.B) {
	ctx := context.Background()
	pr := newProbedReplica(b)
	e, node := pr.e, pr.node

	type row struct {
		interval time.Duration
		jobs     int
		qps      float64
		lat      []time.Duration
	}
	var rows []row
	for b.Loop() {
		rows = rows[:0]
		for _, interval := range []time.Duration{time.Millisecond, replay.DefaultWaitPollInterval} {
			r, err := NewRouter(ctx, e.config(b, func(cfg *Config) {
				cfg.Databases = map[string]replay.Database{"main": {Primary: e.primary, Replicas: []replay.Replica{{Name: "r1", Pool: e.replicas[0]}}}}
				cfg.Tracker.PollInterval = replay.DefaultPollInterval
				cfg.Tracker.WaitPollInterval = interval
				cfg.WaitBudget = time.Minute
				cfg.Logger = nil
			}))
			require.NoError(b, err)
			for _, jobs := range []int{1, 50} {
				// round pauses replay, starts jobs waiting on fresh
				// tokens, holds the pause for hold (measuring the
				// tracker's queries if asked), resumes and returns the
				// catch-up → return latencies.
				round := func(hold time.Duration, measure bool) (float64, []time.Duration) {
					require.NoError(b, node.PauseReplay(ctx))
					toks := make([]position.LSN, jobs)
					var wg sync.WaitGroup
					returned := make([]time.Time, jobs)
					outcomes := make([]Outcome, jobs)
					for i := range jobs {
						_, tok := e.write(b)
						toks[i] = tok.Entries[0].LSN
						wg.Go(func() {
							_, d, err := r.Route(ctx, Job{Token: tok, Policy: Delayed})
							returned[i] = time.Now()
							if err != nil {
								b.Errorf("route: %v", err)
							}
							outcomes[i] = d.Outcome
						})
					}
					for watchers(r, 0) < jobs {
						time.Sleep(100 * time.Microsecond)
					}
					var qps float64
					if measure {
						c0, t0 := pr.statusQueries(b), time.Now()
						time.Sleep(hold)
						qps = float64(pr.statusQueries(b)-c0) / time.Since(t0).Seconds()
					} else {
						time.Sleep(hold)
					}
					passed := pr.resumeAndWatch(b, toks...)
					wg.Wait()
					var lat []time.Duration
					for i := range jobs {
						if outcomes[i] == OutcomeReplicaWaited {
							lat = append(lat, max(returned[i].Sub(passed[i]), 0))
						}
					}
					return qps, lat
				}
				qps, lat := round(10*time.Second, true)
				rounds := 100
				if jobs > 1 {
					rounds = 10
				}
				for range rounds {
					_, l := round(20*time.Millisecond, false)
					lat = append(lat, l...)
				}
				rows = append(rows, row{interval, jobs, qps, lat})
			}
			require.NoError(b, r.Close())
		}
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "\n| WaitPollInterval | waiting jobs | replica queries/s (server side, 10 s pause) | catch-up → wait returns p50 | p99 | samples |\n|---|---|---|---|---|---|\n")
	for _, rw := range rows {
		fmt.Fprintf(&tb, "| %v | %d | %.0f | %v | %v | %d |\n", rw.interval, rw.jobs, rw.qps,
			latency.Percentile(rw.lat, 0.5).Round(10*time.Microsecond), latency.Percentile(rw.lat, 0.99).Round(10*time.Microsecond), len(rw.lat))
		b.ReportMetric(rw.qps, fmt.Sprintf("queries/s-%v-%djobs", rw.interval, rw.jobs))
	}
	b.Log(tb.String())
}
