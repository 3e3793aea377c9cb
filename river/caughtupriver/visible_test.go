package caughtupriver_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/river/caughtupriver"
)

// A job whose transaction was still open when a position read scanned
// River's table is not given that read's position: it gets a position
// read after its own fetch. The first job's read scans while the second
// job's transaction is open; the second commits while every replica is
// paused, so the first read's position (which the replicas have) would
// send it to a replica without its row.
func TestEarlierReadSkipsOpenTransactions(t *testing.T) {
	e := setup(t, func(c *consume.Config) {
		c.WaitBudget = 50 * time.Millisecond
		c.DeferInitial = 200 * time.Millisecond
	})
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{})), false)
	e.insertTx(t, ctx, c, 1)
	open, err := e.primary.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = open.Rollback(ctx) }()
	_, err = open.Exec(ctx, `INSERT INTO items (id, val) VALUES (2, $1)`, value(2))
	require.NoError(t, err)
	_, err = c.InsertTx(ctx, open, itemArgs{ID: 2}, nil)
	require.NoError(t, err)
	// A commit flushes the WAL the open transaction has inserted, which
	// replicas otherwise get only at the WAL writer's next flush.
	e.write(t, ctx, 99)
	require.NoError(t, e.cluster.WaitReplicasCaughtUp(ctx))

	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { require.NoError(t, c.Stop(context.Background())) })
	r := next(t, runs, time.Minute)
	require.Equal(t, int64(1), r.id)
	require.NoError(t, r.err)
	require.Equal(t, value(1), r.val)

	resume := e.pauseAll(t)
	require.NoError(t, open.Commit(ctx))
	deadline := time.Now().Add(time.Minute)
	for e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": "deferred"}) == 0 {
		require.True(t, time.Now().Before(deadline), "job 2 was not snoozed within a minute of paused replay")
		select {
		case r := <-runs:
			t.Fatalf("job 2 ran before any replica had its commit: %+v", r)
		case <-time.After(20 * time.Millisecond):
		}
	}
	resume()
	r = next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, value(2), r.val)
	require.Zero(t, e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "earlier_read"}),
		"neither job was waiting, committed, when a read scanned")
}

// Many producers insert jobs with InsertTx in the transaction of the row
// each reads, while replay pauses and resumes on one replica or both, and
// the worker takes jobs by positions read after their fetch, by earlier
// reads' scans and by the positions kept at their snoozes: every job reads
// its row (0 stale), runs once to completion (0 lost), and no attempt is
// spent on lag.
func TestInsertTxConcurrentUnderPausedReplay(t *testing.T) {
	e := setup(t, func(c *consume.Config) {
		c.WaitBudget = 20 * time.Millisecond
		c.DeferInitial = 100 * time.Millisecond
		c.DeferMax = 400 * time.Millisecond
	})
	ctx := ctxT(t)
	const producers, each = 8, 150
	var stale, failed atomic.Int64
	done := make(chan int64, producers*each)
	w := &itemWorker{fn: func(ctx context.Context, job *river.Job[itemArgs]) error {
		v, err := read(ctx, job.Args.ID)
		switch {
		case errors.Is(err, pgx.ErrNoRows), err == nil && v != value(job.Args.ID):
			stale.Add(1)
		case err != nil:
			failed.Add(1)
			return err
		}
		if job.Attempt != 1 {
			failed.Add(1)
		}
		done <- job.Args.ID
		return nil
	}}
	c := e.client(t, clientConfig(20, w, e.middleware(t, caughtupriver.Config{})), false)
	// A backlog first, so that reads' scans find jobs waiting.
	for id := int64(1); id <= 200; id++ {
		e.insertTx(t, ctx, c, 1_000_000+id)
	}
	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { require.NoError(t, c.Stop(context.Background())) })

	stopPauses := make(chan struct{})
	var pw sync.WaitGroup
	pw.Go(func() {
		rng := rand.New(rand.NewPCG(1, 2))
		nodes := e.cluster.Replicas()
		for {
			paused := nodes
			if rng.IntN(3) == 0 {
				paused = nodes[rng.IntN(len(nodes)):][:1]
			}
			for _, n := range paused {
				if err := n.PauseReplay(ctx); err != nil {
					t.Errorf("pause: %v", err)
				}
			}
			select {
			case <-stopPauses:
			case <-time.After(time.Duration(100+rng.IntN(400)) * time.Millisecond):
			}
			for _, n := range paused {
				if err := n.ResumeReplay(context.Background()); err != nil {
					t.Errorf("resume: %v", err)
				}
			}
			select {
			case <-stopPauses:
				return
			case <-time.After(time.Duration(rng.IntN(200)) * time.Millisecond):
			}
		}
	})
	var pg sync.WaitGroup
	for p := range producers {
		pg.Go(func() {
			for i := range each {
				id := int64(p*each + i + 1)
				err := pgx.BeginFunc(ctx, e.primary, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `INSERT INTO items (id, val) VALUES ($1, $2)`, id, value(id)); err != nil {
						return err
					}
					_, err := c.InsertTx(ctx, tx, itemArgs{ID: id}, nil)
					return err
				})
				if err != nil {
					t.Errorf("insert job %d: %v", id, err)
					return
				}
				time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
			}
		})
	}
	pg.Wait()
	close(stopPauses)
	pw.Wait()

	seen := map[int64]bool{}
	for len(seen) < producers*each+200 {
		select {
		case id := <-done:
			require.False(t, seen[id], "job %d ran twice to completion", id)
			seen[id] = true
		case <-time.After(time.Minute):
			t.Fatalf("%d of %d jobs completed", len(seen), producers*each+200)
		}
	}
	require.Zero(t, stale.Load(), "stale reads")
	require.Zero(t, failed.Load(), "failed or retried runs")
	toks := map[string]int64{}
	for _, s := range []string{"fetch", "earlier_read", "snoozed"} {
		toks[s] = e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": s})
	}
	snoozes := e.sum(t, "caughtup.consume.decisions", map[string]string{"caughtup.outcome": "deferred"})
	t.Logf("tokens by source: %v; snoozes: %d", toks, snoozes)
	require.Positive(t, toks["fetch"])
	require.Positive(t, toks["earlier_read"])
	require.Positive(t, snoozes, "no job was snoozed: the pauses did not reach the jobs")
}
