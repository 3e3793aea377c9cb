package cdc

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/internal/pgtest"
)

// TestMain shares one primary and one streaming replica between the
// tests; each test uses its own database. Tests that pause replay do not
// run in parallel.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{Replicas: 1}),
		// pgtest's signal handler lives as long as the process.
		goleak.IgnoreTopFunction("os/signal.signal_recv"),
		goleak.IgnoreTopFunction("os/signal.loop"),
	)
}

// env is one test's database on the shared cluster, with a table the
// changes go into.
type env struct {
	c           *pgtest.Cluster
	db          string
	primary     *pgxpool.Pool
	replicaNode *pgtest.Node
	replica     *pgxpool.Pool
}

func setup(t *testing.T) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	primary, err := c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	t.Cleanup(primary.Close)
	rn := c.Replicas()[0]
	replica, err := rn.Pool(ctx, db)
	require.NoError(t, err)
	t.Cleanup(replica.Close)
	_, err = primary.Exec(ctx, "CREATE TABLE cdc (id bigint PRIMARY KEY)")
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	t.Cleanup(func() { _ = rn.ResumeReplay(context.Background()) })
	return &env{c: c, db: db, primary: primary, replicaNode: rn, replica: replica}
}

// pauseReplay pauses replay on the replica. A pause takes effect when the
// replica next replays a record, so the request is made first and then a
// transaction on the primary provides that record; PauseReplay then
// waits for the pause state (on an idle cluster the next record could be
// 15 s away: the periodic running-xacts record).
func (e *env) pauseReplay(ctx context.Context) error {
	if _, err := e.replica.Exec(ctx, "SELECT pg_wal_replay_pause()"); err != nil {
		return err
	}
	if err := e.flushWAL(ctx); err != nil {
		return err
	}
	return e.replicaNode.PauseReplay(ctx)
}

// flushWAL commits a transaction that writes a commit record, which
// flushes all WAL before it, so that the WAL of still-open transactions
// reaches the replicas: walsenders send only flushed WAL, and the WAL
// writer leaves a partial page alone.
func (e *env) flushWAL(ctx context.Context) error {
	_, err := e.primary.Exec(ctx, "SELECT pg_current_xact_id()")
	return err
}

// toggleReplay injects lag: it pauses and resumes replay on the replica
// at random short intervals until stopped, and leaves it resumed.
func (e *env) toggleReplay(t *testing.T, ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			_ = e.pauseReplay(ctx)
			pause(ctx, time.Duration(rand.IntN(40))*time.Millisecond)
			_ = e.replicaNode.ResumeReplay(context.Background())
			pause(ctx, time.Duration(rand.IntN(15))*time.Millisecond)
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
			require.NoError(t, e.replicaNode.ResumeReplay(context.Background()))
		})
	}
	t.Cleanup(stop)
	return stop
}

// pause is one step of a fault schedule, not a wait for a condition.
func pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
