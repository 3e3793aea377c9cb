package consume

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"
)

// TestHold: a job that may be neither deferred nor refused waits for the
// cap instead of reading the primary uncharged, and is counted once; one
// that may be refused is refused; a held job whose context ends returns
// its error and reads nothing.
func TestHold(t *testing.T) {
	t.Parallel()
	s := snap(dbState("main", 1, nil, rep("r1", 1, "0/1000000")))
	r := unitRouter(t, s, func(c *Config) {
		c.PrimaryRate, c.PrimaryBurst = rate.Every(200*time.Millisecond), 1
		c.Now = func() time.Time { return t0 }
	})
	behind := tok(time.Second, ent("main", 1, "0/2000000"))
	ctx := context.Background()

	_, d, err := r.Route(ctx, Job{Token: behind, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomePrimary, d.Outcome, "the burst")

	_, d, err = r.Route(ctx, Job{Token: behind, Policy: Sticky})
	require.ErrorIs(t, err, ErrCapped, "refusable: refused")
	require.Equal(t, OutcomeCapped, d.Outcome)

	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	_, d, err = r.Route(short, Job{Token: behind, Policy: Sticky, NoDefer: true, Hold: true})
	require.ErrorIs(t, err, context.DeadlineExceeded, "held until its context ended")
	require.Equal(t, ActionRefuse, d.Action)

	start := time.Now()
	hctx, d, err := r.Route(ctx, Job{Token: behind, Policy: Sticky, NoDefer: true, Hold: true})
	require.NoError(t, err)
	require.True(t, d.Held)
	require.Equal(t, OutcomePrimary, d.Outcome)
	require.Equal(t, ReasonReplicaBehind, d.Reason)
	require.Same(t, r.pools["main"].Primary, DB(hctx, "main"))
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond, "it waited for the cap to refill")
}
