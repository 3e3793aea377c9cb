package consume

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/position"
)

// checkSampled checks that each source got at least the first warnFirst
// lines and no more than one per warnInterval after that, over elapsed.
func checkSampled(t *testing.T, perSource map[string]int, sources []string, elapsed time.Duration) {
	t.Helper()
	most := warnFirst + int(elapsed/warnInterval) + 1
	require.Len(t, perSource, len(sources), "%v", perSource)
	for _, src := range sources {
		require.GreaterOrEqual(t, perSource[src], warnFirst, "source %q", src)
		require.LessOrEqual(t, perSource[src], most, "source %q", src)
	}
}

// TestMalformedTokenWarnings: the warning for a token that does not
// decode carries the decode error, whose excerpt of the text is escaped
// and bounded, and is sampled per source, while every job is counted.
func TestMalformedTokenWarnings(t *testing.T) {
	t.Parallel()
	logs := &captured{}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/1"))), func(c *Config) {
		c.Logger = slog.New(logs)
		c.MeterProvider = mp
	})
	// A producer that writes binary junk, at length.
	bad := "v1;\x00\xff\x1b[31m" + strings.Repeat("junk ", 10000)
	_, decodeErr := position.Decode(bad)
	require.Error(t, decodeErr)

	sources := []string{"asynq email:send", "kafka user-events", ""}
	start := time.Now()
	for _, src := range sources {
		ctx := context.Background()
		for i := range 20 {
			var d Decision
			var err error
			if i%2 == 0 {
				_, d, err = r.Route(ctx, withSource(hjob(bad, Delayed), src))
			} else {
				_, d, err = r.Route(ctx, Job{TokenErr: decodeErr, Policy: Delayed, Source: src})
			}
			require.NoError(t, err)
			require.Equal(t, ReasonMalformedToken, d.Reason)
		}
	}
	elapsed := time.Since(start)

	perSource := map[string]int{}
	for _, l := range logs.lines("caughtup: routed job") {
		perSource[l["caughtup.source"]]++
		require.Equal(t, "malformed_token", l["caughtup.reason"])
		require.Equal(t, decodeErr.Error(), l["error"], "the decode error")
		require.Contains(t, l["error"], `\x00\xff\x1b[31mjunk`, "the offending text, escaped")
		require.Less(t, len(l["error"]), 400, "and bounded")
	}
	checkSampled(t, perSource, sources, elapsed)
	require.Equal(t, map[string]int64{"caughtup.reason=malformed_token,db.system.name=postgresql": 60},
		sums(t, reader)["caughtup.consume.tokens.missing"], "every job is counted")
}

// TestClockSkewWarning: a token captured past the tolerance ahead of the
// router's clock reads the primary rather than being deferred, is
// counted, and the producer's skew is logged, sampled per source.
func TestClockSkewWarning(t *testing.T) {
	t.Parallel()
	logs := &captured{}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"))), func(c *Config) {
		c.Logger = slog.New(logs)
		c.MeterProvider = mp
		c.Now = func() time.Time { return t0 }
		c.WaitBudget = -1
	})
	sources := []string{"asynq report:build", ""}
	start := time.Now()
	for _, src := range sources {
		ctx := context.Background()
		for range 10 {
			_, d, err := r.Route(ctx, Job{Token: position.Of(t0.Add(time.Hour), ent("main", 1, "0/4000000")), Policy: Delayed, Source: src})
			require.NoError(t, err, "not deferred")
			require.Equal(t, OutcomePrimary, d.Outcome)
			require.Equal(t, ReasonUnknownAge, d.Reason)
			require.Equal(t, time.Hour, d.ClockSkew)
		}
		// Within the tolerance: aged from 0, deferred, not counted.
		_, d, err := r.Route(ctx, Job{Token: position.Of(t0.Add(time.Second), ent("main", 1, "0/4000000")), Policy: Delayed, Source: src})
		require.ErrorIs(t, err, ErrDeferred)
		require.Zero(t, d.ClockSkew)
	}
	elapsed := time.Since(start)

	perSource := map[string]int{}
	for _, l := range logs.lines("caughtup: token captured in the future") {
		perSource[l["caughtup.source"]]++
		require.Equal(t, "1h0m0s", l["caughtup.clock_skew"])
		require.Equal(t, DefaultClockSkewTolerance.String(), l["caughtup.clock_skew_tolerance"])
	}
	checkSampled(t, perSource, sources, elapsed)
	require.Equal(t, map[string]int64{"db.system.name=postgresql": 20}, sums(t, reader)["caughtup.consume.tokens.future"])
}

// Past maxWarnSources, new sources share the sampler of jobs without one.
func TestWarnSourcesBounded(t *testing.T) {
	t.Parallel()
	var w warnings
	for i := range maxWarnSources {
		w.sampler(warnKey{reason: ReasonMalformedToken, source: strconv.Itoa(i)})
	}
	none := w.sampler(warnKey{reason: ReasonMalformedToken})
	require.Same(t, none, w.sampler(warnKey{reason: ReasonMalformedToken, source: "one too many"}))
	require.NotSame(t, none, w.sampler(warnKey{reason: ReasonMalformedToken, source: "7"}), "known sources keep theirs")
	require.Len(t, w.m, maxWarnSources+1)
}

func withSource(j Job, source string) Job {
	j.Source = source
	return j
}
