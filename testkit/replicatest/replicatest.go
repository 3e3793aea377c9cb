// Package replicatest gives a test its own database on pgtest's shared
// cluster, with a pool on the primary and one on the first replica, and
// makes that replica fall behind on demand: pause its replay so that the
// pause holds at once, or pause and resume it at random while the test
// writes. The cdc and outbox tests use it; each test that pauses replay
// must not run in parallel with others on the shared cluster.
//
//	db := replicatest.New(t)
//	require.NoError(t, db.PauseReplay(ctx))
//	// … writes on db.Primary are not on db.Replica …
//	require.NoError(t, db.ReplicaNode.ResumeReplay(ctx))
package replicatest

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

// DB is one test's database on the shared cluster.
type DB struct {
	Cluster     *pgtest.Cluster
	Database    string // the test's own, on every node
	Primary     *pgxpool.Pool
	ReplicaNode *pgtest.Node // the shared cluster's first replica
	Replica     *pgxpool.Pool
}

// New creates a database on pgtest.Shared(t) and opens a pool on the
// primary and one on the first replica, closed when the test ends.
func New(t testing.TB) *DB {
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
	return &DB{Cluster: c, Database: db, Primary: primary, ReplicaNode: rn, Replica: replica}
}

// PauseReplay pauses replay on the replica. A pause takes effect when the
// replica next replays a record, so the request is made first and then a
// transaction on the primary provides that record; the node's PauseReplay
// then waits for the pause state (on an idle cluster the next record could
// be 15 s away: the periodic running-xacts record).
func (d *DB) PauseReplay(ctx context.Context) error {
	if err := pgtest.RequestReplayPause(ctx, d.Replica); err != nil {
		return err
	}
	if err := d.FlushWAL(ctx); err != nil {
		return err
	}
	return d.ReplicaNode.PauseReplay(ctx)
}

// FlushWAL commits a transaction that writes a commit record, which
// flushes all WAL before it, so that the WAL of still-open transactions
// reaches the replicas: walsenders send only flushed WAL, and the WAL
// writer leaves a partial page alone.
func (d *DB) FlushWAL(ctx context.Context) error {
	_, err := d.Primary.Exec(ctx, "SELECT pg_current_xact_id()")
	return err
}

// ToggleReplay injects lag: it pauses and resumes replay on the replica
// at random short intervals until stop is called or the test ends, and
// leaves it resumed. The pauses between steps are the fault's schedule,
// not waits for a condition.
func (d *DB) ToggleReplay(t testing.TB, ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			_ = d.PauseReplay(ctx)
			Sleep(ctx, time.Duration(rand.IntN(40))*time.Millisecond)
			_ = d.ReplicaNode.ResumeReplay(context.Background())
			Sleep(ctx, time.Duration(rand.IntN(15))*time.Millisecond)
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
			require.NoError(t, d.ReplicaNode.ResumeReplay(context.Background()))
		})
	}
	t.Cleanup(stop)
	return stop
}

// Sleep pauses for d, or less if ctx ends: one step of a fault or
// workload schedule, never a wait for a condition.
func Sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
