package caughtupriver_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/river/caughtupriver"
)

const wokenMetric = "caughtup.river.wake.jobs"

// longSnooze routes with a short wait and a one-minute snooze: a job that
// runs before its snooze's scheduled_at was woken, whatever the machine's
// pace (River fetches nothing scheduled ahead of the database's clock).
func longSnooze(c *consume.Config) {
	c.WaitBudget = 50 * time.Millisecond
	c.DeferInitial = time.Minute
	c.DeferMax = time.Minute
}

// snoozedRows waits until n jobs are snoozed (a snooze counted, and
// scheduled; or available with a scheduled_at ahead, as River writes a
// snooze shorter than its scheduler's interval) and returns each one's scheduled_at, when its snooze ends.
func (e *dbEnv) snoozedRows(t testing.TB, n int) map[int64]time.Time {
	t.Helper()
	out := map[int64]time.Time{}
	require.Eventually(t, func() bool {
		rows, err := e.primary.Query(ctxT(t), `SELECT id, scheduled_at FROM river_job
			WHERE metadata ? 'snoozes' AND (state = 'scheduled' OR state = 'available' AND scheduled_at > now())`)
		if err != nil {
			return false
		}
		got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
			ID int64
			At time.Time
		}, error) {
			var v struct {
				ID int64
				At time.Time
			}
			err := r.Scan(&v.ID, &v.At)
			return v, err
		})
		if err != nil || len(got) < n {
			return false
		}
		for _, g := range got {
			out[g.ID] = g.At
		}
		return true
	}, time.Minute, 20*time.Millisecond, "%d jobs were not all snoozed within a minute of paused replay", n)
	return out
}

// Jobs snoozed for lag (inserted with Insert and with InsertTx) run as soon
// as a replica has replayed their tokens, long before their one-minute
// snoozes end, each once, on its first attempt, on a replica that shows its
// row; the InsertTx jobs are routed by the position kept at their snooze,
// with no read of the primary.
func TestWakeAtCatchUp(t *testing.T) {
	e := setup(t, longSnooze)
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(10, w, e.middleware(t, caughtupriver.Config{})), true)
	resume := e.pauseAll(t)
	const each = 20
	for id := int64(1); id <= 2*each; id++ {
		if id <= each {
			e.insertTx(t, ctx, c, id)
			continue
		}
		_, err := caughtupriver.Insert(e.write(t, ctx, id), c, itemArgs{ID: id}, nil)
		require.NoError(t, err)
	}
	until := e.snoozedRows(t, 2*each)
	select {
	case r := <-runs:
		t.Fatalf("a job ran while every replica was paused: %+v", r)
	default:
	}
	reads := e.sum(t, readsMetric, nil)
	resume()

	seen := map[int64]bool{}
	for range 2 * each {
		r := next(t, runs, 50*time.Second)
		require.NoError(t, r.err)
		require.Equal(t, value(r.id), r.val, "job %d read stale", r.id)
		require.False(t, seen[r.id], "job %d ran twice", r.id)
		seen[r.id] = true
		require.Equal(t, 1, r.attempt, "job %d: a snooze and a wake spend no attempt", r.id)
		require.Contains(t, []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited}, r.decision.Outcome, "job %d: %+v", r.id, r.decision)
	}
	for id, end := range until {
		job := waitState(t, c, id, rivertype.JobStateCompleted)
		require.Equal(t, 1, job.Attempt)
		require.Empty(t, job.Errors)
		require.True(t, job.AttemptedAt.Before(end), "job %d ran at %v, its snooze ended at %v: it was not woken", id, job.AttemptedAt, end)
	}
	require.Equal(t, int64(2*each), e.sum(t, wokenMetric, nil), "each snooze woken once")
	require.Equal(t, int64(each), e.sum(t, tokensMetric, map[string]string{"caughtup.river.token": "snoozed"}), "the InsertTx jobs are routed by the position kept at their snooze")
	require.Equal(t, reads, e.sum(t, readsMetric, nil), "no read of the primary after the wake")
	require.Zero(t, e.sum(t, "caughtup.river.wake.dropped", nil))
}

// A job made available while its replicas are still behind (as a wake that
// came too early would) is routed again and snoozed again: it does not
// run, spends no attempt and records no error; once replay resumes it is
// woken and runs.
func TestWokenStillBehindSnoozesAgain(t *testing.T) {
	e := setup(t, longSnooze)
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{})), true)
	resume := e.pauseAll(t)
	res := e.insertTx(t, ctx, c, 1)
	e.snoozedRows(t, 1)
	// River's JobRetry, as an early wake: available now, attempt kept.
	_, err := c.JobRetry(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		job, err := c.JobGet(ctx, res.Job.ID)
		return err == nil && job.State == rivertype.JobStateScheduled && snoozes(t, job) == 2
	}, time.Minute, 20*time.Millisecond, "the job was not snoozed again")
	job, err := c.JobGet(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Zero(t, job.Attempt, "the second snooze gave its attempt back too")
	require.Empty(t, job.Errors)
	select {
	case r := <-runs:
		t.Fatalf("the job ran while every replica was paused: %+v", r)
	default:
	}
	resume()
	r := next(t, runs, 50*time.Second)
	require.NoError(t, r.err)
	require.Equal(t, value(1), r.val)
	require.Equal(t, 1, r.attempt)
	done := waitState(t, c, res.Job.ID, rivertype.JobStateCompleted)
	require.Equal(t, 1, done.Attempt)
	require.Empty(t, done.Errors)
}

func snoozes(t testing.TB, job *rivertype.JobRow) int {
	t.Helper()
	var md struct {
		Snoozes int `json:"snoozes"`
	}
	require.NoError(t, json.Unmarshal(job.Metadata, &md))
	return md.Snoozes
}

// The snooze is the safety net: the jobs of a client that stopped (as of a
// process that died) are not woken by anyone, and run when their snoozes
// end, on another client, on their first attempt.
func TestSnoozeEndsWithoutWaker(t *testing.T) {
	e := setup(t, func(c *consume.Config) {
		c.WaitBudget = 50 * time.Millisecond
		c.DeferInitial = 3 * time.Second
		c.DeferMax = 3 * time.Second
	})
	ctx := ctxT(t)
	w, runs := recorder()
	first := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{})), false)
	require.NoError(t, first.Start(ctx))
	resume := e.pauseAll(t)
	res := e.insertTx(t, ctx, first, 1)
	until := e.snoozedRows(t, 1)[res.Job.ID]
	stopCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	require.NoError(t, first.Stop(stopCtx))
	cancel()
	require.Eventually(t, func() bool {
		return e.sum(t, "caughtup.river.wake.dropped", map[string]string{"caughtup.river.wake.reason": "stopped"}) == 1
	}, 10*time.Second, 10*time.Millisecond, "the stopped client's snoozed job is forgotten")
	resume()
	e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{})), true)
	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, value(1), r.val)
	require.Equal(t, 1, r.attempt)
	job := waitState(t, first, res.Job.ID, rivertype.JobStateCompleted)
	require.False(t, job.AttemptedAt.Before(until), "attempted at %v, before its snooze ended at %v, but no one woke it", job.AttemptedAt, until)
	require.Zero(t, e.sum(t, wokenMetric, nil))
}

// With WakeCapacity -1 nothing is remembered: jobs run when their snoozes
// end.
func TestWakeDisabled(t *testing.T) {
	e := setup(t, func(c *consume.Config) {
		c.WaitBudget = 50 * time.Millisecond
		c.DeferInitial = 2 * time.Second
		c.DeferMax = 2 * time.Second
	})
	ctx := ctxT(t)
	w, runs := recorder()
	c := e.client(t, clientConfig(4, w, e.middleware(t, caughtupriver.Config{WakeCapacity: -1})), true)
	resume := e.pauseAll(t)
	wctx := e.write(t, ctx, 1)
	res, err := caughtupriver.Insert(wctx, c, itemArgs{ID: 1}, &river.InsertOpts{})
	require.NoError(t, err)
	until := e.snoozedRows(t, 1)[res.Job.ID]
	resume()
	r := next(t, runs, time.Minute)
	require.NoError(t, r.err)
	require.Equal(t, value(1), r.val)
	job := waitState(t, c, res.Job.ID, rivertype.JobStateCompleted)
	require.False(t, job.AttemptedAt.Before(until))
	require.Zero(t, e.sum(t, "caughtup.river.wake.remembered", nil))
	require.Zero(t, e.sum(t, wokenMetric, nil))
}
