package outbox

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/fault"
)

var errCrash = errors.New("relay process killed")

// The relays must lose nothing when they die between claiming (or
// receiving) a batch and publishing it, or between the broker's
// acknowledgement and marking (or confirming) it. Each case kills the
// relay at one point once, restarts it, and checks that every event was
// published at least once — and that the batch caught between publish and
// mark was published again, which shows the kill landed where intended.
//
// The kills are injected by wrapping the real things: the publisher
// (fault.Publisher, around the in-memory broker) and, for the logical
// relay, its connections (fault.Dialer, which drops the replication
// socket without a goodbye, as a dead process would).

func TestPollingRelayCrashLosesNothing(t *testing.T) {
	t.Parallel()
	for _, at := range []fault.Point{fault.BeforePublish, fault.AfterPublish} {
		t.Run(map[fault.Point]string{fault.BeforePublish: "after-claim", fault.AfterPublish: "after-publish"}[at], func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ids := e.writeOrders(t, ctx, 1, 30)
			pub := newMemPublisher()
			fp := fault.NewPublisher(pub.Publish)
			// The crash ends the relay's transaction without COMMIT, as a
			// dead process's would: the rows are neither deleted nor
			// marked, and their locks are released.
			fp.Inject(fault.Fault[Event]{At: at, Err: errCrash})
			crashing, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: fp, BatchSize: 10, Logger: quiet})
			require.NoError(t, err)
			_, err = crashing.RelayOnce(ctx)
			require.ErrorIs(t, err, errCrash)
			require.Len(t, fp.Hit(), 1)
			crashed := fp.Hit()[0]
			require.Len(t, crashed, 10)

			restarted, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: pub, BatchSize: 10, Logger: quiet})
			require.NoError(t, err)
			for {
				n, err := restarted.RelayOnce(ctx)
				require.NoError(t, err)
				if n == 0 {
					break
				}
			}
			got := pub.waitFor(t, ctx, ids)
			for _, ev := range crashed {
				want := 1
				if at == fault.AfterPublish {
					want = 2
				}
				require.Len(t, got[ev.ID], want, "event %s", ev.ID)
			}
			var left int
			require.NoError(t, e.Primary.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&left))
			require.Zero(t, left)
		})
	}
}

// TestPollingRelayConnectionKilled kills the relay's backend with
// pg_terminate_backend, once before a publish and once between a publish
// and the mark, while Run keeps going.
func TestPollingRelayConnectionKilled(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	relayPool, err := pgxpool.New(ctx, e.Cluster.Primary().DSN(e.Database)+"&application_name=doomed_relay")
	require.NoError(t, err)
	defer relayPool.Close()
	ids := e.writeOrders(t, ctx, 1, 30)
	kill := func([]Event) {
		// Wait until the backend is really gone: the kill must land before
		// the relay's next statement.
		_, err := e.Primary.Exec(ctx, "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE application_name = 'doomed_relay' AND datname = current_database()")
		assert.NoError(t, err)
	}
	pub := newMemPublisher()
	fp := fault.NewPublisher(pub.Publish)
	fp.Inject(
		// Killed after the claim, before the publish.
		fault.Fault[Event]{At: fault.BeforePublish, Do: kill, Err: errCrash},
		// Published and acknowledged; the mark will hit a dead connection.
		fault.Fault[Event]{At: fault.AfterPublish, Do: kill},
	)
	r, err := NewPollingRelay(PollingConfig{Primary: relayPool, Publisher: fp, BatchSize: 10, PollInterval: 5 * time.Millisecond, MinBackoff: time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	runInBackground(t, ctx, r.Run)
	waitSpent(t, ctx, fp)
	pub.waitFor(t, ctx, ids)
	afterPublish := fp.Hit()[1]
	require.Len(t, afterPublish, 10)
	pub.waitFor(t, ctx, eventIDs(afterPublish), 2) // republished after the kill
	require.Eventually(t, func() bool {
		var n int
		return e.Primary.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&n) == nil && n == 0
	}, 10*time.Second, 10*time.Millisecond)
	got := pub.byID()
	for _, ev := range afterPublish {
		require.Len(t, got[ev.ID], 2, "republished once after the kill, and only once")
	}
}

// TestPollingRelayCancelledMidBatch stops Run through its context while a
// batch is published and starts a fresh relay.
func TestPollingRelayCancelledMidBatch(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ids := e.writeOrders(t, ctx, 1, 25)
	pub := newMemPublisher()
	runCtx, stop := context.WithCancel(ctx)
	fp := fault.NewPublisher(pub.Publish)
	fp.Inject(
		fault.Fault[Event]{At: fault.AfterPublish}, // lets the first batch through
		// The broker acknowledged; the mark will see a cancelled context.
		fault.Fault[Event]{At: fault.AfterPublish, Do: func([]Event) { stop() }},
	)
	r, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: fp, BatchSize: 10, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, r.Run(runCtx))
	var left int
	require.NoError(t, e.Primary.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&left))
	require.Equal(t, 15, left, "the second batch was published but not marked")
	r2, err := NewPollingRelay(PollingConfig{Primary: e.Primary, Publisher: pub, BatchSize: 10, PollInterval: 5 * time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	runInBackground(t, ctx, r2.Run)
	pub.waitFor(t, ctx, ids)
	dups := 0
	for _, evs := range pub.byID() {
		dups += len(evs) - 1
	}
	require.Equal(t, 10, dups)
}

func TestLogicalRelayCrashLosesNothing(t *testing.T) {
	t.Parallel()
	for _, at := range []fault.Point{fault.BeforePublish, fault.AfterPublish} {
		t.Run(map[fault.Point]string{fault.BeforePublish: "after-receive", fault.AfterPublish: "after-publish"}[at], func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			pub := newMemPublisher()
			fp := fault.NewPublisher(pub.Publish)
			d := fault.NewDialer(nil)
			r := newLogical(t, e, LogicalConfig{Publisher: fp, DialFunc: d.DialContext})
			require.NoError(t, r.Setup(ctx))
			// The relay dies: its sockets are reset without a goodbye and
			// nothing is confirmed. Run reconnects: the restart.
			fp.Inject(fault.Fault[Event]{At: at, Err: errCrash, Do: func([]Event) {
				assert.NotZero(t, d.Cut(), "the replication connection was live")
			}})
			ids := e.writeOrders(t, ctx, 1, 20)
			runInBackground(t, ctx, r.Run)
			pub.waitFor(t, ctx, ids)
			waitSpent(t, ctx, fp)
			crashed := fp.Hit()[0]
			require.NotEmpty(t, crashed)
			// The crash may come after the first publish, which already
			// satisfies waitFor: wait for the republish too.
			want := 1
			if at == fault.AfterPublish {
				want = 2
			}
			pub.waitFor(t, ctx, eventIDs(crashed), want)
			dialed, _, _ := d.Stats()
			require.GreaterOrEqual(t, dialed, 2, "Run reconnected through the dialer after the crash")
			got := pub.byID()
			for _, ev := range crashed {
				require.Len(t, got[ev.ID], want, "event %s", ev.ID)
			}
		})
	}
}

// TestLogicalRelayWalsenderKilled terminates the relay's walsender after a
// publish was acknowledged and before the confirm, then, in a second
// phase, cancels Run between receive and publish and starts a new relay
// instance.
func TestLogicalRelayWalsenderKilled(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pub := newMemPublisher()
	fp := fault.NewPublisher(pub.Publish)
	r := newLogical(t, e, LogicalConfig{Publisher: fp})
	require.NoError(t, r.Setup(ctx))
	// Acknowledge the batch, but kill the walsender first and wait until
	// the slot is free, so the confirm cannot reach it.
	fp.Inject(fault.Fault[Event]{At: fault.AfterPublish, Do: func([]Event) {
		_, err := e.Primary.Exec(ctx, "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots WHERE slot_name = $1", r.cfg.Slot)
		assert.NoError(t, err)
	}})
	ids := e.writeOrders(t, ctx, 1, 20)
	stop := runInBackground(t, ctx, r.Run)
	pub.waitFor(t, ctx, ids)
	waitSpent(t, ctx, fp)
	first := fp.Hit()[0]
	require.NotEmpty(t, first)
	pub.waitFor(t, ctx, eventIDs(first), 2) // acknowledged but not confirmed before the kill: republished

	// Phase 2: stop between receive and publish, then a new instance.
	runCtx, cancelRun := context.WithCancel(ctx)
	stop()
	fp.Inject(fault.Fault[Event]{At: fault.BeforePublish, Do: func([]Event) { cancelRun() }, Err: context.Canceled})
	more := e.writeOrders(t, ctx, 100, 20)
	require.NoError(t, r.Run(runCtx))
	waitSpent(t, ctx, fp)
	r2 := newLogical(t, e, LogicalConfig{Publisher: pub, Slot: r.cfg.Slot})
	runInBackground(t, ctx, r2.Run)
	pub.waitFor(t, ctx, more)
}

// waitSpent waits until every fault injected into fp has landed.
func waitSpent(t *testing.T, ctx context.Context, fp *fault.Publisher[Event]) {
	t.Helper()
	select {
	case <-fp.Spent():
	case <-ctx.Done():
		t.Fatalf("injected faults never landed (%d publish calls): %v", fp.Calls(), ctx.Err())
	}
}
