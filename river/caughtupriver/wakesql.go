package caughtupriver

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// wokenKey is the job metadata key the wake writes: the snooze count of
// the snooze it ended early. The Middleware reads it to know that a job
// came back by the wake rather than by River's JobRetry (see
// snoozedToken).
const wokenKey = "caughtup-woken"

// riverInsertTopic is River's insert notification topic (its internal
// notifier.NotificationTopicInsert), on which a producer listening for
// new jobs of a queue fetches at once; the channel is the schema (or
// current_schema()) and the topic joined by a dot, and the payload
// {"queue": …}, as riverpgxv5's PGNotifyMany sends it. Without the
// notification a woken job waits for the producer's next FetchPollInterval
// (1s by default); a client in poll-only mode gets nothing from it.
const riverInsertTopic = "river_insert"

// wakeSQL returns the wake statement for River's job table in schema ("":
// the search_path's). For each job ($1 ids, $2 the attempt and $3 the
// snooze count the snooze left in its row, $4 whether to write wokenKey:
// the snooze kept a position) it makes the job available now,
// in one UPDATE, only if its row is still in that snooze: scheduled, or
// available with a scheduled_at still ahead (River writes a snooze shorter
// than its scheduler's interval as available), with that attempt and that
// snooze count. Only state, scheduled_at and the wokenKey of metadata
// change. It then notifies the producers of each queue a job was woken in,
// and returns one code per job, in order (wakeCode).
//
// Both reads of the table look the jobs up by their primary key (id =
// ANY): joined to the unnest alone, the planner may scan the whole table.
//
// The codes other than woken come from the row as the statement's snapshot
// saw it, before any lock: a job whose snooze River's completer wrote
// while the statement ran may show as running, and is tried again.
func wakeSQL(schema string) string {
	table := "river_job"
	topic := "current_schema()"
	if schema != "" {
		table = pgx.Identifier{schema, "river_job"}.Sanitize()
		topic = quoteLiteral(schema)
	}
	return `WITH want AS (
	SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::bool[]) WITH ORDINALITY AS w(id, attempt, snoozes, mark, ord)
), woken AS (
	UPDATE ` + table + ` AS j
	SET state = 'available', scheduled_at = now(),
		metadata = CASE WHEN want.mark THEN j.metadata || jsonb_build_object('` + wokenKey + `', want.snoozes) ELSE j.metadata END
	FROM want
	WHERE j.id = ANY($1::bigint[]) AND j.id = want.id
		AND j.attempt = want.attempt
		AND j.metadata -> 'snoozes' = to_jsonb(want.snoozes)
		AND (j.state = 'scheduled' OR (j.state = 'available' AND j.scheduled_at > now()))
	RETURNING j.id, j.queue
), notified AS (
	SELECT q.queue, pg_notify(concat(` + topic + `, '.', '` + riverInsertTopic + `'), json_build_object('queue', q.queue)::text)
	FROM (SELECT DISTINCT queue FROM woken) AS q
)
SELECT coalesce(array_agg(CASE
		WHEN woken.id IS NOT NULL THEN 1
		WHEN j.id IS NULL THEN 0
		WHEN j.state = 'running' THEN -1
		WHEN j.state = 'available' THEN -2
		WHEN j.state IN ('completed', 'cancelled', 'discarded') THEN -3
		ELSE -4
	END ORDER BY want.ord), '{}'::int[]),
	(SELECT count(*) FROM notified)
FROM want
LEFT JOIN woken ON woken.id = want.id
LEFT JOIN (SELECT id, state FROM ` + table + ` WHERE id = ANY($1::bigint[])) AS j ON j.id = want.id`
}

func quoteLiteral(s string) string {
	out := []byte{'\''}
	for i := 0; i < len(s); i++ {
		if s[i] == '\'' {
			out = append(out, '\'')
		}
		out = append(out, s[i])
	}
	return string(append(out, '\''))
}

// Codes wakeSQL returns per job.
const (
	wakeCodeWoken     = 1
	wakeCodeMissing   = 0  // wakeNotFound
	wakeCodeRunning   = -1 // wakeRunning
	wakeCodeAvailable = -2 // wakeAvailable
	wakeCodeFinished  = -3 // wakeFinished
	wakeCodeChanged   = -4 // wakeChanged
)

func wakeCode(code int32) wakeResult {
	switch code {
	case wakeCodeWoken:
		return wakeResult{woken: true}
	case wakeCodeMissing:
		return wakeResult{err: wakeNotFound}
	case wakeCodeRunning:
		return wakeResult{err: wakeRunning, retry: true}
	case wakeCodeAvailable:
		return wakeResult{err: wakeAvailable}
	case wakeCodeFinished:
		return wakeResult{err: wakeFinished}
	default:
		return wakeResult{err: wakeChanged}
	}
}

// wakeBatchOf runs the wake statement for es, jobs of client, through the
// client's driver, on the database and schema River works them in, and
// returns each job's result, in order.
func wakeBatchOf(ctx context.Context, client *riverClient, es []*wakeEntry) ([]wakeResult, error) {
	ids := make([]int64, len(es))
	attempts := make([]int32, len(es))
	snoozes := make([]int64, len(es))
	marks := make([]bool, len(es))
	for i, e := range es {
		ids[i], attempts[i], snoozes[i], marks[i] = e.Key.id, int32(e.Data.attempt), e.Data.snoozes, e.Data.mark
	}
	var (
		codes    []int32
		notified int64
	)
	err := client.Driver().GetExecutor().QueryRow(ctx, wakeSQL(client.Schema()), ids, attempts, snoozes, marks).Scan(&codes, &notified)
	if err != nil {
		return nil, fmt.Errorf("caughtup/river: waking %d snoozed jobs: %w", len(es), err)
	}
	if len(codes) != len(es) {
		return nil, fmt.Errorf("caughtup/river: the wake statement returned %d codes for %d jobs", len(codes), len(es))
	}
	out := make([]wakeResult, len(es))
	for i, c := range codes {
		out[i] = wakeCode(c)
	}
	return out, nil
}
