package outbox

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

var errCrash = errors.New("relay process killed")

// The relays must lose nothing when they die between claiming (or
// receiving) a batch and publishing it, or between the broker's
// acknowledgement and marking (or confirming) it. Each case kills the
// relay at one point once, restarts it, and checks that every event was
// published at least once — and that the batch caught between publish and
// mark was published again, which shows the kill landed where intended.

func TestPollingRelayCrashLosesNothing(t *testing.T) {
	t.Parallel()
	for _, at := range []string{"after-claim", "after-publish"} {
		t.Run(at, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ids := e.writeOrders(t, ctx, 1, 30)
			pub := newMemPublisher()
			crashing, err := NewPollingRelay(PollingConfig{DB: e.primary, Publisher: pub, BatchSize: 10, Logger: quiet})
			require.NoError(t, err)
			var crashed []Event
			hook := func(_ context.Context, events []Event) error { crashed = events; return errCrash }
			if at == "after-claim" {
				crashing.hooks.afterClaim = hook
			} else {
				crashing.hooks.afterPublish = hook
			}
			_, err = crashing.RelayOnce(ctx)
			require.ErrorIs(t, err, errCrash)
			require.Len(t, crashed, 10)

			restarted, err := NewPollingRelay(PollingConfig{DB: e.primary, Publisher: pub, BatchSize: 10, Logger: quiet})
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
				if at == "after-publish" {
					want = 2
				}
				require.Len(t, got[ev.ID], want, "event %s", ev.ID)
			}
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
	relayPool, err := pgxpool.New(ctx, e.c.Primary().DSN(e.db)+"&application_name=doomed_relay")
	require.NoError(t, err)
	defer relayPool.Close()
	ids := e.writeOrders(t, ctx, 1, 30)
	kill := func() error {
		// Wait until the backend is really gone: the kill must land before
		// the relay's next statement.
		_, err := e.primary.Exec(ctx, "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE application_name = 'doomed_relay' AND datname = current_database()")
		return err
	}
	pub := newMemPublisher()
	var firstAfterPublish atomic.Pointer[[]Event]
	pub.fail = func(call int, events []Event) error {
		switch call {
		case 1: // killed after the claim, before the publish
			if err := kill(); err != nil {
				return err
			}
			return errCrash
		}
		return nil
	}
	r, err := NewPollingRelay(PollingConfig{DB: relayPool, Publisher: pub, BatchSize: 10, PollInterval: 5 * time.Millisecond, MinBackoff: time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	var calls atomic.Int32
	r.hooks.afterPublish = func(_ context.Context, events []Event) error {
		if calls.Add(1) == 1 { // published; the mark will hit a dead connection
			firstAfterPublish.Store(&events)
			return kill()
		}
		return nil
	}
	runInBackground(t, ctx, r.Run)
	pub.waitFor(t, ctx, ids)
	require.Eventually(t, func() bool {
		var n int
		return e.primary.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&n) == nil && n == 0
	}, 10*time.Second, 10*time.Millisecond)
	got := pub.byID()
	require.NotNil(t, firstAfterPublish.Load())
	require.Len(t, *firstAfterPublish.Load(), 10)
	for _, ev := range *firstAfterPublish.Load() {
		require.Len(t, got[ev.ID], 2, "republished after the kill")
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
	pub.fail = func(call int, _ []Event) error {
		if call == 2 {
			stop() // the broker acknowledged; the mark will see a cancelled context
		}
		return nil
	}
	r, err := NewPollingRelay(PollingConfig{DB: e.primary, Publisher: pub, BatchSize: 10, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, r.Run(runCtx))
	var left int
	require.NoError(t, e.primary.QueryRow(ctx, "SELECT count(*) FROM outbox").Scan(&left))
	require.Equal(t, 15, left, "the second batch was published but not marked")
	pub.fail = nil
	r2, err := NewPollingRelay(PollingConfig{DB: e.primary, Publisher: pub, BatchSize: 10, PollInterval: 5 * time.Millisecond, Logger: quiet})
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
	for _, at := range []string{"after-receive", "after-publish"} {
		t.Run(at, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			pub := newMemPublisher()
			r := newLogical(t, e, LogicalConfig{Publisher: pub})
			require.NoError(t, r.Setup(ctx))
			var crashes atomic.Int32
			var crashedP atomic.Pointer[[]Event]
			hook := func(_ context.Context, events []Event) error {
				if crashes.Add(1) == 1 {
					c := append([]Event(nil), events...)
					crashedP.Store(&c)
					return errCrash // the relay drops its socket without confirming
				}
				return nil
			}
			if at == "after-receive" {
				r.hooks.afterClaim = hook
			} else {
				r.hooks.afterPublish = hook
			}
			ids := e.writeOrders(t, ctx, 1, 20)
			runInBackground(t, ctx, r.Run) // Run reconnects: the restart
			pub.waitFor(t, ctx, ids)
			// The crash comes after the first publish, which already
			// satisfies waitFor: wait for the republish too.
			want := 1
			if at == "after-publish" {
				want = 2
			}
			require.Eventually(t, func() bool {
				p := crashedP.Load()
				if p == nil {
					return false
				}
				got := pub.byID()
				for _, ev := range *p {
					if len(got[ev.ID]) < want {
						return false
					}
				}
				return true
			}, 10*time.Second, 5*time.Millisecond)
			got := pub.byID()
			for _, ev := range *crashedP.Load() {
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
	r := newLogical(t, e, LogicalConfig{Publisher: pub})
	require.NoError(t, r.Setup(ctx))
	var firstP atomic.Pointer[[]Event]
	pub.fail = func(call int, events []Event) error {
		if call != 1 {
			return nil
		}
		first := append([]Event(nil), events...)
		firstP.Store(&first)
		// Acknowledge the batch, but kill the walsender first and wait
		// until the slot is free, so the confirm cannot reach it.
		_, err := e.primary.Exec(ctx, "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots WHERE slot_name = $1", r.cfg.Slot)
		return err
	}
	ids := e.writeOrders(t, ctx, 1, 20)
	stop := runInBackground(t, ctx, r.Run)
	pub.waitFor(t, ctx, ids)
	first := *firstP.Load()
	require.NotEmpty(t, first)
	require.Eventually(t, func() bool {
		got := pub.byID()
		for _, ev := range first {
			if len(got[ev.ID]) < 2 {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond, "the batch acknowledged but not confirmed before the kill is republished")

	// Phase 2: stop between receive and publish, then a new instance.
	runCtx, cancelRun := context.WithCancel(ctx)
	stop()
	var stopped atomic.Bool
	pub.fail = func(int, []Event) error {
		if stopped.CompareAndSwap(false, true) {
			cancelRun()
			return context.Canceled
		}
		return nil
	}
	more := e.writeOrders(t, ctx, 100, 20)
	require.NoError(t, r.Run(runCtx))
	require.True(t, stopped.Load())
	r2 := newLogical(t, e, LogicalConfig{Publisher: pub, Slot: r.cfg.Slot})
	runInBackground(t, ctx, r2.Run)
	pub.waitFor(t, ctx, more)
}
