package lab

import (
	"bytes"
	"context"
	"io"
	"os"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

func TestMain(m *testing.M) {
	// TestFleetShort starts this binary again as its worker processes.
	if IsFleetWorker() {
		os.Exit(RunFleetWorker(context.Background(), os.Stdin, os.Stdout, os.Stderr))
	}
	// The suite starts its own services (it kills, stops and promotes
	// nodes, which the shared ones must not see); pgtest.Wrap still owns
	// the process-wide cleanup and closes anything shared before goleak
	// looks for leftovers.
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{}))
}

// TestChaosShort runs the short suite in process, as CI does: every
// scenario and the comparison, on real services (PostgreSQL with streaming
// replicas, redis-server, and an Apache Kafka broker from testkit/kafkatest
// or the cluster $KAFKA_BROKERS names). It fails, never skips, when they
// cannot start. CHAOS_RUN, a regular expression as the program's -run,
// runs only the scenarios it matches (at least one; "compare": the
// comparison), each checked as in the whole run.
func TestChaosShort(t *testing.T) {
	began := time.Now()
	out := &progress{start: began, w: func(s string) { t.Log(s) }}
	var tables bytes.Buffer
	o := options{short: true, scale: shortScale}
	if only := os.Getenv("CHAOS_RUN"); only != "" {
		o.only = regexp.MustCompile(only)
	}
	selected := func(name string) bool { return o.only == nil || o.only.MatchString(name) }
	res := runSuite(t.Context(), o, out, io.Discard, &tables)
	t.Logf("short suite in %s:\n%s", time.Since(began).Round(time.Second), tables.String())

	require.NotEmpty(t, res.Scenarios, "no scenario ran")
	require.NotEmpty(t, res.Kafka, "the Kafka pipelines ran on no broker")
	for _, sc := range res.Scenarios {
		require.NotEmpty(t, sc.Streams, "scenario %s did not run: %v", sc.Name, sc.Failures)
		for _, st := range sc.Streams {
			require.Zero(t, st.Stale, "%s/%s: stale reads: %v", sc.Name, st.Stream, st.StaleExamples)
			require.Zero(t, st.Lost, "%s/%s: lost jobs, e.g. %v", sc.Name, st.Stream, st.LostExamples)
			require.Equal(t, st.Jobs, st.Completed, "%s/%s", sc.Name, st.Stream)
			require.LessOrEqual(t, st.MaxFallbackPerSec, sc.CapWindowLimit, "%s/%s: fallback reads over the cap", sc.Name, st.Stream)
			require.Zero(t, st.RetriedWithoutFailure, "%s/%s: retry counts grown by deferrals", sc.Name, st.Stream)
		}
		all := sc.Streams[len(sc.Streams)-1]
		switch sc.Name {
		case "replay-pause":
			// Kafka in both modes, and the catch-up -> start latency
			// measured for the jobs the pause held (figures are in the
			// table, not asserted).
			require.Len(t, sc.Streams, 4, "asynq, kafka in place, kafka retry topic and all")
			for _, st := range sc.Streams {
				require.Positive(t, st.Paused.N, "%s: no job enqueued during the pause was measured", st.Stream)
				require.Zero(t, st.Paused.Never, "%s: jobs the recorded snapshots never show caught up", st.Stream)
			}
		case "lag-spike-cap":
			require.Equal(t, 40, sc.CapWindowLimit, "the cap scenario runs at 20/s with a burst of 20")
			require.LessOrEqual(t, all.MaxPrimaryPerSec, sc.CapWindowLimit, "primary reads over the cap")
			require.Positive(t, all.Capped, "the cap was never exercised")
		case "forged-feed":
			require.NotNil(t, sc.Forged, "forged-feed injected nothing")
			require.Positive(t, sc.Forged.Injected)
			require.Equal(t, sc.Forged.Injected, sc.Forged.Rejected, "forged messages injected vs rejected: %v vs %v", sc.Forged.ByCounter, sc.Forged.RejectedByCounter)
		case "timeout-tasks":
			require.Equal(t, timeoutCapRate+timeoutCapBurst, sc.CapWindowLimit)
			require.LessOrEqual(t, all.MaxPrimaryPerSec, sc.CapWindowLimit, "primary reads over the cap")
			require.Positive(t, all.Deferrals, "no task was deferred")
		case "adapters", "adapters-pause":
			// Every pipeline, each with jobs of its own; through the long
			// pause, the catch-up -> start latency measured for each.
			var names []string
			for _, st := range sc.Streams {
				names = append(names, st.Stream)
				require.Positive(t, st.Jobs, "%s: no job went through it", st.Stream)
				if sc.Name == "adapters-pause" {
					require.Positive(t, st.Paused.N, "%s: no job enqueued during the pause was measured", st.Stream)
					require.Zero(t, st.Paused.Never, "%s: jobs the recorded snapshots never show caught up", st.Stream)
				}
			}
			require.Equal(t, []string{"asynq", "kafka", "kafka-retry", "river", "river-tx", "kgo", "all"}, names)
		case "unreachable-replica":
			// Every pipeline; a replica's failure spends no attempt and
			// sets no job aside.
			var names []string
			for _, st := range sc.Streams {
				names = append(names, st.Stream)
				require.Zero(t, st.DeadLetters, "%s: dead-lettered", st.Stream)
				require.Zero(t, st.RetriedRuns, "%s: jobs completed with a retry count above 0", st.Stream)
			}
			require.Equal(t, []string{"asynq", "kafka", "kafka-retry", "river", "river-tx", "kgo", "all"}, names)
		}
	}
	want := 0
	for _, sc := range scenarios(shortScale) {
		if selected(sc.name) {
			want++
		}
	}
	require.Len(t, res.Scenarios, want)
	if !selected("compare") {
		require.Empty(t, res.Failures)
		return
	}
	require.NotNil(t, res.Comparison, "the comparison did not run")
	require.Len(t, res.Comparison.Totals, 3)
	for _, st := range res.Comparison.Streams {
		require.Zero(t, st.Lost, "comparison %s: lost jobs", st.Stream)
		if st.Policy == "caughtup" {
			require.Zero(t, st.Stale, "comparison %s: stale reads: %v", st.Stream, st.StaleExamples)
		}
	}
	require.Empty(t, res.Failures)
}

// TestFleetShort runs the fleet simulation at a tiny scale (3 routers on
// the feed in 2 worker processes, 2 polling by themselves), so that the
// program behind `make fleet` keeps working; its figures are printed by
// the program, never asserted here.
func TestFleetShort(t *testing.T) {
	out := &progress{start: time.Now(), w: func(s string) { t.Log(s) }}
	o := fleetOptions{feedNs: []int{3}, localNs: []int{2}, trials: 2, idle: 500 * time.Millisecond, spike: time.Second,
		spikeRate: 200, budget: fleetBudget{Rate: 20, Burst: 20, Timeout: 500 * time.Millisecond}, perProcess: 2, batch: 2}
	rows, err := runFleet(t.Context(), o, out)
	var tables bytes.Buffer
	printFleet(&tables, rows, o)
	t.Log(tables.String())
	require.NoError(t, err)
	require.Len(t, rows, 2)
	for _, r := range rows {
		require.Empty(t, r.Err, "%s N=%d", r.Mode, r.Routers)
		require.Equal(t, 2*r.Routers, r.Samples, "%s N=%d: one wake per router per trial", r.Mode, r.Routers)
		require.Equal(t, map[string]int{"replica_waited": r.Samples}, r.Outcomes)
		require.Positive(t, r.SpikeAttempts)
	}
	require.Equal(t, 2, rows[0].Processes)
}
