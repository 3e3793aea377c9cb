package caughtupriver

import (
	"context"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/caughtup/caughtup/position"
)

const (
	// visibleScan bounds the jobs one position read registers: one index
	// range scan of River's primary key, a few milliseconds at most.
	visibleScan = 2000
	// visibleCapacity bounds the jobs registered and not fetched yet (by
	// this process: jobs other processes fetch are never looked up here,
	// and go oldest first); about 60 bytes each.
	visibleCapacity = 50_000
)

// visibleJobs remembers, for the jobs of one River schema, a position read
// after a snapshot that showed them committed and available: such a job
// needs no read after its fetch, and its position is older, so a replica
// has usually replayed it already and the job does not wait for the
// tracker's next observation. This is what makes a job inserted with
// InsertTx as cheap to route as one that carries its producer's token,
// whenever it waited in the queue through one position read (a backlog).
//
// Each position read first runs visibleSQL through the job's River client
// (River's database and schema), then reads the position (fetchPositions).
// Why the position covers every job the scan returned, in PostgreSQL's
// terms:
//
//  1. The scan is one statement under READ COMMITTED: it sees the row
//     versions written by the transactions that had completed when its
//     snapshot was taken, at the statement's start (GetSnapshotData), and
//     no others.
//  2. A transaction's commit record is inserted into the WAL
//     (RecordTransactionCommit: XLogInsert reserves its space, moving the
//     insert position past its end) before the transaction is marked
//     completed in the proc array (ProcArrayEndTransaction), so before any
//     snapshot can show it. That holds with synchronous_commit off too:
//     only the flush is deferred, not the insert.
//  3. The scan has returned to this process before the position read is
//     sent, so pg_current_wal_insert_lsn() is read after the scan's
//     snapshot was taken, and is at or past the end of the commit record
//     of every transaction that snapshot showed completed (design notes,
//     facts 1 and 2: the insert position, not the write position, and an
//     end position compares with pg_last_wal_replay_lsn()).
//  4. So a replica that has replayed the position has replayed the commit
//     of the transaction that wrote the version the scan saw, and of every
//     transaction that committed before it (the inserting transaction of
//     the job, and what it read): a hot standby makes a transaction visible
//     when it replays its commit record.
//
// The position stands for the job only if the version its fetch took is
// the one the scan saw, and no run of the job since may have written what
// it now reads. River's fetch adds one to attempt; a snooze gives the
// attempt back but counts itself in the metadata's "snoozes"; an error or
// a rescue keeps the attempt. So a job fetched with the scan's attempt
// plus one and the scan's snooze count was not fetched in between, and no
// worker ran it (lookup checks both, and forgets the job at its first
// lookup). Unique jobs are left out: a duplicate River skipped changes no
// row, and its writes would not be covered. What else can touch an
// available job that no one fetched is River's JobRetry, which leaves an
// available job as it is, and JobCancel or JobDelete, after which it is
// not fetched.
type visibleJobs struct {
	mu     sync.Mutex
	after  int64 // the highest id a scan returned: the next scan starts above it
	byID   map[int64]visibleJob
	order  []int64 // registration order, for eviction; may hold looked-up ids
	oldest int     // order[oldest:] is live
	// full: the last scan returned visibleScan jobs, so more wait behind
	// them; ahead: a read ahead is under way (fetchPositions.readAhead).
	full, ahead bool
}

// visibleJob is a job a scan saw: its attempt and snooze count then, and
// the position read after the scan.
type visibleJob struct {
	attempt int32
	snoozes int64
	tok     *position.Token
}

// visibleSQL returns the scan for River's job table in schema ("": the
// search_path's): the next available, non-unique jobs above an id ($1),
// at most $2, with their attempts and snooze counts (the metadata's
// "snoozes" as JSON text, NULL when absent).
func visibleSQL(schema string) string {
	table := "river_job"
	if schema != "" {
		table = pgx.Identifier{schema, "river_job"}.Sanitize()
	}
	return `SELECT coalesce(array_agg(id ORDER BY id), '{}'::bigint[]),
	coalesce(array_agg(attempt ORDER BY id), '{}'::int[]),
	coalesce(array_agg((metadata -> 'snoozes')::text ORDER BY id), '{}'::text[])
FROM (SELECT id, attempt, metadata FROM ` + table + `
	WHERE id > $1 AND state = 'available' AND unique_key IS NULL
	ORDER BY id LIMIT $2) AS s`
}

// visibleScanned is one scan's result, registered once the position read
// after it is known.
type visibleScanned struct {
	v        *visibleJobs
	ids      []int64
	attempts []int32
	snoozes  []*string
}

// scan runs the scan of v's schema through client, before a position read.
func (v *visibleJobs) scan(ctx context.Context, client *riverClient) (visibleScanned, error) {
	v.mu.Lock()
	after := v.after
	v.mu.Unlock()
	s := visibleScanned{v: v}
	err := client.Driver().GetExecutor().QueryRow(ctx, visibleSQL(client.Schema()), after, visibleScan).Scan(&s.ids, &s.attempts, &s.snoozes)
	if err != nil || len(s.ids) != len(s.attempts) || len(s.ids) != len(s.snoozes) {
		return visibleScanned{}, err
	}
	return s, nil
}

// register records the scanned jobs with tok, the position read after the
// scan returned.
func (s visibleScanned) register(tok position.Token) {
	v := s.v
	if v == nil || len(s.ids) == 0 {
		return
	}
	shared := &tok
	v.mu.Lock()
	defer v.mu.Unlock()
	v.full = len(s.ids) == visibleScan
	for i, id := range s.ids {
		var n int64
		if s.snoozes[i] != nil {
			n = snoozeCount([]byte(`{"snoozes":` + *s.snoozes[i] + `}`))
		}
		if _, ok := v.byID[id]; !ok {
			v.order = append(v.order, id)
		}
		v.byID[id] = visibleJob{attempt: s.attempts[i], snoozes: n, tok: shared}
		v.after = max(v.after, id)
	}
	for len(v.byID) > visibleCapacity && v.oldest < len(v.order) {
		delete(v.byID, v.order[v.oldest])
		v.oldest++
	}
	if v.oldest > len(v.order)/2 {
		v.order = append(v.order[:0], v.order[v.oldest:]...)
		v.oldest = 0
	}
}

// startAhead reports whether a read ahead should start now, and if so
// marks it under way: the last scan left jobs behind it, and fewer than
// half a scan's worth of those it registered are left, so that the next
// fetches would miss and wait for a read of their own.
func (v *visibleJobs) startAhead() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	if !v.full || v.ahead || len(v.byID) >= visibleScan/2 {
		return false
	}
	v.ahead = true
	return true
}

func (v *visibleJobs) endAhead() {
	v.mu.Lock()
	v.ahead = false
	v.mu.Unlock()
}

// lookup returns the position registered for job, if job is the version
// the scan saw (see visibleJobs), and forgets the job either way.
func (v *visibleJobs) lookup(job *rivertype.JobRow) (position.Token, bool) {
	v.mu.Lock()
	r, ok := v.byID[job.ID]
	if ok {
		delete(v.byID, job.ID)
	}
	v.mu.Unlock()
	if !ok || job.UniqueKey != nil || int(r.attempt)+1 != job.Attempt || r.snoozes != snoozeCount(job.Metadata) {
		return position.Token{}, false
	}
	return *r.tok, true
}

// visibleRegistry holds a visibleJobs per River client: ids are per job
// table, and a client names one (its driver's database, its schema).
type visibleRegistry struct {
	mu sync.Mutex
	m  map[*riverClient]visibleOf
}

type visibleOf struct {
	v       *visibleJobs
	stopped <-chan struct{} // the client's run the jobs were seen for
}

// of returns the visibleJobs of the River client ctx carries, nil without
// one (a driver other than riverpgxv5).
func (r *visibleRegistry) of(ctx context.Context) (*visibleJobs, *riverClient) {
	client, err := river.ClientFromContextSafely[pgx.Tx](ctx)
	if err != nil {
		return nil, nil
	}
	stopped := client.Stopped()
	r.mu.Lock()
	defer r.mu.Unlock()
	if e, ok := r.m[client]; ok && e.stopped == stopped {
		return e.v, client
	}
	if r.m == nil {
		r.m = make(map[*riverClient]visibleOf)
	}
	// A client seen for the first time, or started again: the clients
	// whose runs have ended are forgotten (they fetch nothing more).
	for c, e := range r.m {
		if e.stopped != nil && closed(e.stopped) {
			delete(r.m, c)
		}
	}
	v := &visibleJobs{byID: make(map[int64]visibleJob)}
	r.m[client] = visibleOf{v: v, stopped: stopped}
	return v, client
}

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
