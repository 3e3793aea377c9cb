package consume

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/position"
)

// TestTally: jobs routed through a Tally get the Router's decisions, and
// their counts reach the same series as the Router's own, once flushed.
func TestTally(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := unitRouter(t, snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"))), func(c *Config) {
		c.Now = func() time.Time { return t0 }
		c.WaitBudget = -1
		c.MeterProvider = mp
	})
	ctx := context.Background()
	caught := tok(time.Second, ent("main", 1, "0/1000000"))
	other := position.Of(t0, position.Entry{Database: "main", Epoch: position.Epoch{SystemID: 1, Timeline: 1}, LSN: 1})

	route := func(rd func(context.Context, position.Token, error, Policy) (context.Context, Decision, error)) {
		_, d, err := rd(ctx, caught, nil, Sticky)
		require.NoError(t, err)
		require.Equal(t, OutcomeReplica, d.Outcome)
		_, d, err = rd(ctx, position.Token{}, nil, Sticky)
		require.NoError(t, err)
		require.Equal(t, OutcomePrimaryNoToken, d.Outcome)
		_, d, err = rd(ctx, other, nil, Sticky)
		require.NoError(t, err)
		require.Equal(t, OutcomePrimaryEpoch, d.Outcome)
	}
	route(r.RouteDecoded)
	direct := sums(t, reader)

	tally := r.NewTally()
	route(tally.RouteDecoded)
	require.Equal(t, direct, sums(t, reader), "nothing added before Flush")
	tally.Flush(ctx)
	flushed := sums(t, reader)
	for _, name := range []string{"caughtup.consume.decisions", "caughtup.consume.database.routes",
		"caughtup.consume.tokens.missing", "caughtup.consume.tokens.cross_epoch"} {
		require.NotEmpty(t, direct[name], name)
		for k, v := range direct[name] {
			require.Equal(t, 2*v, flushed[name][k], "%s{%s}: the Tally's counts add to the same series", name, k)
		}
	}
	tally.Flush(ctx)
	require.Equal(t, flushed, sums(t, reader), "a second Flush adds nothing")
}
