package caughtupriver

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

type wakeArgs struct{}

func (wakeArgs) Kind() string { return "wake" }

// The wake statement makes available exactly the jobs still in the
// snooze it was given (scheduled, or available with a scheduled_at ahead;
// that attempt; that snooze count), touches nothing else of them but
// state, scheduled_at and the woken mark, leaves every other job as it
// is, and tells River's producers of the queues it woke jobs in.
func TestWakeStatement(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	pool, err := c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	defer pool.Close()
	m, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	require.NoError(t, err)
	_, err = m.Migrate(ctx, rivermigrate.DirectionUp, nil)
	require.NoError(t, err)
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
	require.NoError(t, err)

	type row struct {
		name     string
		state    rivertype.JobState
		attempt  int
		snoozes  int64
		ahead    bool // scheduled_at in an hour, else a second ago
		want     wakeResult
		wakeable bool
	}
	rows := []row{
		{name: "scheduled", state: rivertype.JobStateScheduled, attempt: 2, snoozes: 3, ahead: true, want: wakeResult{woken: true}, wakeable: true},
		{name: "short snooze", state: rivertype.JobStateAvailable, attempt: 0, snoozes: 1, ahead: true, want: wakeResult{woken: true}, wakeable: true},
		{name: "due scheduled", state: rivertype.JobStateScheduled, attempt: 0, snoozes: 1, want: wakeResult{woken: true}, wakeable: true},
		{name: "snoozed again", state: rivertype.JobStateScheduled, attempt: 0, snoozes: 2, ahead: true, want: wakeResult{err: wakeChanged}},
		{name: "ran since", state: rivertype.JobStateScheduled, attempt: 1, snoozes: 1, ahead: true, want: wakeResult{err: wakeChanged}},
		{name: "snooze not written yet", state: rivertype.JobStateRunning, attempt: 1, snoozes: 0, want: wakeResult{err: wakeRunning, retry: true}},
		{name: "completed", state: rivertype.JobStateCompleted, attempt: 0, snoozes: 1, want: wakeResult{err: wakeFinished}},
		{name: "discarded", state: rivertype.JobStateDiscarded, attempt: 0, snoozes: 1, want: wakeResult{err: wakeFinished}},
		{name: "already available", state: rivertype.JobStateAvailable, attempt: 0, snoozes: 1, want: wakeResult{err: wakeAvailable}},
		{name: "retryable", state: rivertype.JobStateRetryable, attempt: 0, snoozes: 1, ahead: true, want: wakeResult{err: wakeChanged}},
	}
	var es []*wakeEntry
	ids := map[int64]row{}
	for _, r := range rows {
		res, err := client.Insert(ctx, wakeArgs{}, &river.InsertOpts{ScheduledAt: time.Now().Add(time.Hour), MaxAttempts: 5})
		require.NoError(t, err)
		at := "now() - interval '1 second'"
		if r.ahead {
			at = "now() + interval '1 hour'"
		}
		var finalized any
		if r.state == rivertype.JobStateCompleted || r.state == rivertype.JobStateDiscarded {
			finalized = time.Now()
		}
		_, err = pool.Exec(ctx, `UPDATE river_job SET state = $2, attempt = $3, metadata = jsonb_build_object('snoozes', $4::bigint, 'app', 'x'),
			scheduled_at = `+at+`, finalized_at = $5 WHERE id = $1`, res.Job.ID, string(r.state), r.attempt, r.snoozes, finalized)
		require.NoError(t, err, r.name)
		ids[res.Job.ID] = r
		// The snooze the entry waits on: attempt 0, the first snooze,
		// except for the rows that are this snooze under another state.
		want := wakeJob{attempt: 0, snoozes: 1, mark: true}
		if r.name == "scheduled" {
			want = wakeJob{attempt: 2, snoozes: 3}
		}
		es = append(es, &wakeEntry{Key: jobKey{client: client, id: res.Job.ID}, Data: want})
	}
	es = append(es, &wakeEntry{Key: jobKey{client: client, id: 1 << 40}, Data: wakeJob{snoozes: 1}})

	listen, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer listen.Release()
	_, err = listen.Exec(ctx, `LISTEN "public.river_insert"`)
	require.NoError(t, err)

	before := time.Now()
	got, err := wakeBatchOf(ctx, client, es)
	require.NoError(t, err)
	require.Len(t, got, len(es))
	require.Equal(t, wakeResult{err: wakeNotFound}, got[len(got)-1], "a job that does not exist")
	for i, e := range es[:len(es)-1] {
		r := ids[e.Key.id]
		require.Equal(t, r.want, got[i], r.name)
		job, err := client.JobGet(ctx, e.Key.id)
		require.NoError(t, err)
		require.Equal(t, r.attempt, job.Attempt, "%s: the attempt is never touched", r.name)
		require.Equal(t, 5, job.MaxAttempts, "%s: nor max_attempts", r.name)
		var md map[string]any
		require.NoError(t, json.Unmarshal(job.Metadata, &md))
		require.Equal(t, "x", md["app"], "%s: the metadata is kept", r.name)
		if r.wakeable {
			require.Equal(t, rivertype.JobStateAvailable, job.State, r.name)
			require.False(t, job.ScheduledAt.After(time.Now()), "%s: due now", r.name)
			if e.Data.mark {
				require.EqualValues(t, e.Data.snoozes, md[wokenKey], "%s: marked with the snooze it ended", r.name)
			} else {
				require.NotContains(t, md, wokenKey, "%s: a snooze that kept no position is not marked", r.name)
			}
			continue
		}
		require.Equal(t, r.state, job.State, "%s: left alone", r.name)
		require.NotContains(t, md, wokenKey, r.name)
	}

	// One notification for the one queue woken jobs are in, as River's
	// own inserts send.
	nctx, ncancel := context.WithTimeout(ctx, 10*time.Second)
	defer ncancel()
	n, err := listen.Conn().WaitForNotification(nctx)
	require.NoError(t, err)
	require.JSONEq(t, `{"queue":"default"}`, n.Payload)
	require.Less(t, time.Since(before), time.Minute)

	// A schema of River's other than the search_path's: the table and the
	// channel are the schema's.
	_, err = pool.Exec(ctx, `CREATE SCHEMA jobs2`)
	require.NoError(t, err)
	m2, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Schema: "jobs2"})
	require.NoError(t, err)
	_, err = m2.Migrate(ctx, rivermigrate.DirectionUp, nil)
	require.NoError(t, err)
	c2, err := river.NewClient(riverpgxv5.New(pool), &river.Config{Schema: "jobs2"})
	require.NoError(t, err)
	res, err := c2.Insert(ctx, wakeArgs{}, &river.InsertOpts{ScheduledAt: time.Now().Add(time.Hour), Queue: "q2"})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE jobs2.river_job SET metadata = '{"snoozes": 1}' WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)
	_, err = listen.Exec(ctx, `LISTEN `+pgx.Identifier{"jobs2.river_insert"}.Sanitize())
	require.NoError(t, err)
	got, err = wakeBatchOf(ctx, c2, []*wakeEntry{{Key: jobKey{client: c2, id: res.Job.ID}, Data: wakeJob{snoozes: 1, mark: true}}})
	require.NoError(t, err)
	require.Equal(t, []wakeResult{{woken: true}}, got)
	n, err = listen.Conn().WaitForNotification(nctx)
	require.NoError(t, err)
	require.Equal(t, "jobs2.river_insert", n.Channel)
	require.JSONEq(t, `{"queue":"q2"}`, n.Payload)
}

// snoozedToken takes the kept position only for a job fetched straight
// out of the snooze it was kept at: same attempt, same snooze count, and
// back by its snooze's end or by the wake of that snooze.
func TestSnoozedToken(t *testing.T) {
	t.Parallel()
	tok := tokenAt(500)
	enc, err := tok.Encode()
	require.NoError(t, err)
	until := time.UnixMicro(1_700_000_000_000_000)
	job := func(attempt int, snoozes int64, scheduledAt time.Time, woken any) *rivertype.JobRow {
		md := map[string]any{
			"snoozes":  snoozes,
			snoozedKey: snoozed{Token: enc, Attempt: 1, Snoozes: 2, Until: until.UnixMicro()},
		}
		if woken != nil {
			md[wokenKey] = woken
		}
		b, err := json.Marshal(md)
		require.NoError(t, err)
		return &rivertype.JobRow{Attempt: attempt, Metadata: b, ScheduledAt: scheduledAt}
	}
	for _, c := range []struct {
		name string
		job  *rivertype.JobRow
		ok   bool
	}{
		{"back when the snooze ended", job(1, 2, until, nil), true},
		{"back later", job(1, 2, until.Add(time.Second), nil), true},
		{"woken", job(1, 2, until.Add(-time.Minute), 2), true},
		{"made available early by something else (JobRetry)", job(1, 2, until.Add(-time.Microsecond), nil), false},
		{"woken out of an earlier snooze", job(1, 2, until.Add(-time.Minute), 1), false},
		{"an attempt ran since", job(2, 2, until, nil), false},
		{"snoozed again since", job(1, 3, until, nil), false},
		{"no kept position", &rivertype.JobRow{Attempt: 1, Metadata: []byte(`{"snoozes":2}`), ScheduledAt: until}, false},
		{"not a JSON object", &rivertype.JobRow{Attempt: 1, Metadata: []byte(`[1]`), ScheduledAt: until}, false},
	} {
		got, ok := snoozedToken(c.job)
		require.Equal(t, c.ok, ok, c.name)
		if ok {
			require.Equal(t, tok.Entries, got.Entries, c.name)
		}
	}
}
