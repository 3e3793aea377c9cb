package chaos

import (
	"bytes"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/internal/pgtest"
)

func TestMain(m *testing.M) {
	// The suite starts its own services (it kills, stops and promotes
	// nodes, which the shared ones must not see); pgtest.Wrap still owns
	// the process-wide cleanup and closes anything shared before goleak
	// looks for leftovers.
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{}))
}

// TestChaosShort runs the short suite in process, as CI does: every
// scenario and the comparison, on real services (PostgreSQL with streaming
// replicas, redis-server, and an Apache Kafka broker from internal/kafkatest
// or the cluster $KAFKA_BROKERS names). It fails, never skips, when they
// cannot start.
func TestChaosShort(t *testing.T) {
	began := time.Now()
	out := &progress{start: began, w: func(s string) { t.Log(s) }}
	var tables bytes.Buffer
	res := runSuite(t.Context(), options{short: true, scale: shortScale}, out, io.Discard, &tables)
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
		case "timeout-tasks":
			require.Equal(t, timeoutCapRate+timeoutCapBurst, sc.CapWindowLimit)
			require.LessOrEqual(t, all.MaxPrimaryPerSec, sc.CapWindowLimit, "primary reads over the cap")
			require.Positive(t, all.Deferrals, "no task was deferred")
		}
	}
	require.Len(t, res.Scenarios, len(scenarios(shortScale)))
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
