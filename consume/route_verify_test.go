package consume

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// verdicts is a Verifier answering per replica name, recording its calls.
type verdicts struct {
	mu    sync.Mutex
	by    map[string]Verification
	calls []string
}

func (v *verdicts) verify(_ context.Context, dd DatabaseDecision, _ *pgxpool.Pool) Verification {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.calls = append(v.calls, dd.Replica)
	return v.by[dd.Replica]
}

// TestRouteVerified is what Route does around Decide when a Verifier has
// the last word on the replica chosen (no tracker, no waiting: budget -1).
// The handler gets a replica only once the Verifier called it fresh; a
// replica found behind takes every replica at or below it along; a
// replica that cannot tell sends the job to the primary, with a warning
// carrying the Verifier's error; the decisions counter counts each job
// once, as Route does; children never inherit the unverified token.
func TestRouteVerified(t *testing.T) {
	t.Parallel()
	// r1 at 0/3000000, r2 at 0/2000000; the token at 0/1800000 passes
	// both by position.
	s := snap(dbState("main", 1, nil, rep("r1", 1, "0/3000000"), rep("r2", 1, "0/2000000")))
	tk := tok(time.Second, ent("main", 1, "0/1800000"))
	logs := &captured{}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	r := unitRouter(t, s, func(c *Config) {
		c.Now = func() time.Time { return t0 }
		c.WaitBudget = -1
		c.Logger = slog.New(logs)
		c.MeterProvider = mp
	})
	ctx := context.Background()

	t.Run("fresh", func(t *testing.T) {
		v := &verdicts{by: map[string]Verification{"r1": {Verdict: VerifyFresh}, "r2": {Verdict: VerifyFresh}}}
		hctx, d, err := r.Route(ctx, Job{Token: tk, TokenErr: nil, Policy: Delayed, Verify: v.verify})
		require.NoError(t, err)
		require.Equal(t, OutcomeReplica, d.Outcome)
		require.Len(t, v.calls, 1, "one replica chosen, one verification")
		require.Equal(t, v.calls[0], d.Databases[0].Replica)
		child, ok := enqueue.TokenFrom(hctx)
		require.True(t, ok)
		ce, _ := child.Entry("main")
		require.Equal(t, d.Databases[0].ReadAt.LSN, ce.LSN, "children inherit what the replica read had replayed")
		require.Equal(t, position.SourceReplica, ce.Source, "never the unverified position")
	})

	t.Run("the lower replica behind, the higher fresh", func(t *testing.T) {
		v := &verdicts{by: map[string]Verification{
			"r1": {Verdict: VerifyFresh},
			"r2": {Verdict: VerifyBehind, Replayed: lsn("0/2000000")},
		}}
		for range 4 { // Spread rotates: r2 is chosen first at least once
			_, d, err := r.Route(ctx, Job{Token: tk, TokenErr: nil, Policy: Delayed, Verify: v.verify})
			require.NoError(t, err)
			require.Equal(t, "r1", d.Databases[0].Replica)
		}
		require.Contains(t, v.calls, "r2")
	})

	t.Run("the higher replica behind takes the lower along", func(t *testing.T) {
		// r1 is found without the writes at 0/3000000: r2, below it,
		// cannot have them and is never asked.
		v := &verdicts{by: map[string]Verification{
			"r1": {Verdict: VerifyBehind, Replayed: lsn("0/3000000")},
			"r2": {Verdict: VerifyFresh},
		}}
		r1First := 0
		for _, pol := range []Policy{Delayed, Delayed, Delayed, Delayed, Sticky, Sticky, Sticky, Sticky} {
			v.calls = nil
			_, d, err := r.Route(ctx, Job{Token: tk, TokenErr: nil, Policy: pol, Verify: v.verify})
			if v.calls[0] == "r2" {
				require.NoError(t, err, "r2 chosen first is fresh")
				require.Equal(t, "r2", d.Databases[0].Replica)
				continue
			}
			r1First++
			require.Equal(t, []string{"r1"}, v.calls, "r2 is below the bound r1 set")
			require.Equal(t, uint64(1), d.Databases[0].BytesBehind, "r1 must pass its bound by a byte")
			if pol == Delayed {
				var de *DeferError
				require.ErrorAs(t, err, &de, "no replica is past the bound: deferred")
				require.Equal(t, OutcomeDeferred, d.Outcome)
			} else {
				require.NoError(t, err)
				require.Equal(t, OutcomePrimary, d.Outcome, "sticky: the primary at once")
				require.Equal(t, ReasonReplicaBehind, d.Reason)
				require.True(t, d.Fallback)
			}
		}
		require.Positive(t, r1First, "Spread never chose r1 first")
	})

	t.Run("unknown reads the primary", func(t *testing.T) {
		cause := errors.New("replica did not answer")
		v := &verdicts{by: map[string]Verification{"r1": {Err: cause}, "r2": {Err: cause}}}
		hctx, d, err := r.Route(ctx, Job{Token: tk, TokenErr: nil, Policy: Delayed, Verify: v.verify})
		require.NoError(t, err)
		require.Equal(t, OutcomePrimary, d.Outcome)
		require.Equal(t, ReasonUnverified, d.Reason)
		require.Len(t, v.calls, 1, "one unknown is enough")
		_, ok := enqueue.TokenFrom(hctx)
		require.False(t, ok, "a database read on the primary passes no position on")
		lines := logs.lines("caughtup: routed job")
		require.NotEmpty(t, lines)
		last := lines[len(lines)-1]
		require.Equal(t, "unverified", last[attrReason])
		require.Contains(t, last["error"], cause.Error())
	})

	t.Run("malformed and no token never reach the verifier", func(t *testing.T) {
		v := &verdicts{}
		_, d, err := r.Route(ctx, Job{Token: tk, TokenErr: position.ErrMalformed, Policy: Delayed, Verify: v.verify})
		require.NoError(t, err)
		require.Equal(t, ReasonMalformedToken, d.Reason)
		_, d, err = r.Route(ctx, Job{Token: position.Token{}, TokenErr: nil, Policy: Delayed, Verify: v.verify})
		require.NoError(t, err)
		require.Equal(t, ReasonNoToken, d.Reason)
		require.Empty(t, v.calls)
	})

	// One decision counted per routed job, whatever the rounds.
	require.Equal(t, int64(1+4+8+1+2), total(sums(t, reader)["caughtup.consume.decisions"]))
}

// TestRouteVerifiedWaitsForTheCommit: a token below its transaction's
// commit (the insert position read inside the transaction, as a CDC
// change position is) passes every replica's replay while the commit is
// not replayed. The Verifier (here: is the row visible there?) finds the
// replica behind, so the job waits instead of reading it; it does not
// return while replay is paused, and once replay resumes it runs on a
// replica that shows the row.
func TestRouteVerifiedWaitsForTheCommit(t *testing.T) {
	c := pgtest.Shared(t)
	e := setup(t, c)
	r := e.router(t, func(c *Config) { c.WaitBudget = time.Minute })
	ctx := ctxT(t)

	conn, err := e.primary.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	var id int64
	require.NoError(t, tx.QueryRow(ctx, "INSERT INTO items (v) VALUES ('open') RETURNING id").Scan(&id))
	var insideText string
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&insideText))
	inside := capture(t, e.primary, "main")                   // the epoch, and a capture time
	inside.Entries[0].LSN = position.MustParseLSN(insideText) // below the commit
	flush := func() {
		_, err := e.primary.Exec(ctx, "SELECT pg_current_xact_id()") // a commit record flushes the WAL before it
		require.NoError(t, err)
	}
	flush()
	for _, n := range c.Replicas() {
		require.NoError(t, n.WaitReplay(ctx, inside.Entries[0].LSN.String()))
	}
	// Pause every replica past the insert, before the commit. A pause
	// takes effect at the next record replayed: make one.
	for i, n := range c.Replicas() {
		require.NoError(t, pgtest.RequestReplayPause(ctx, e.replicas[i]))
		flush()
		require.NoError(t, n.PauseReplay(ctx))
	}
	t.Cleanup(func() { resumeAll(t, c) })
	require.NoError(t, tx.Commit(ctx))
	seen(t, r, inside)

	var behind atomic.Int64
	verify := func(ctx context.Context, dd DatabaseDecision, pool *pgxpool.Pool) Verification {
		var replay string
		var n int
		if err := pool.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text, (SELECT count(*) FROM items WHERE id = $1)", id).Scan(&replay, &n); err != nil {
			return Verification{Err: err}
		}
		if n == 1 {
			return Verification{Verdict: VerifyFresh}
		}
		behind.Add(1)
		return Verification{Verdict: VerifyBehind, Replayed: position.MustParseLSN(replay)}
	}
	type result struct {
		ctx context.Context
		d   Decision
		err error
	}
	done := make(chan result, 1)
	go func() {
		hctx, d, err := r.Route(context.Background(), Job{Token: inside, Policy: Delayed, Verify: verify})
		done <- result{hctx, d, err}
	}()
	waitUntil(t, r, "the job waits on both replicas after verification", func(*replay.Snapshot) bool {
		return behind.Load() > 0 && waiting(r) == 2
	})
	select {
	case res := <-done:
		t.Fatalf("routed while no replica had replayed the commit: %+v", res.d)
	default:
	}
	resumeAll(t, c)
	res := <-done
	require.NoError(t, res.err)
	require.Equal(t, OutcomeReplicaWaited, res.d.Outcome)
	pool := DB(res.ctx, "main")
	require.NotSame(t, e.primary, pool)
	require.True(t, found(t, pool, id), "the replica handed out shows the row")
	t.Logf("verified behind %d times, waited %v", behind.Load(), res.d.Waited)
}
