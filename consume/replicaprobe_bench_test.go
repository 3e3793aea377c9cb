package consume

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// probedReplica is what BenchmarkFeedInterval and BenchmarkWaitLoad
// measure on: a cluster of their own with one replica that counts its
// status queries (pg_stat_statements), and a connection that watches its
// replay from outside caughtup.
type probedReplica struct {
	c     *pgtest.Cluster
	e     *env
	node  *pgtest.Node
	stats *pgx.Conn
	probe *pgx.Conn
}

func newProbedReplica(b *testing.B) *probedReplica {
	b.Helper()
	ctx := context.Background()
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1, Settings: map[string]string{
		"shared_preload_libraries": "'pg_stat_statements'",
	}})
	require.NoError(b, err)
	b.Cleanup(func() { _ = c.Close() })
	e := setup(b, c)
	_, err = e.primary.Exec(ctx, "CREATE EXTENSION pg_stat_statements")
	require.NoError(b, err)
	require.NoError(b, c.WaitReplicasCaughtUp(ctx))
	p := &probedReplica{c: c, e: e, node: c.Replicas()[0]}
	p.stats, err = pgx.Connect(ctx, p.node.DSN(e.db))
	require.NoError(b, err)
	b.Cleanup(func() { _ = p.stats.Close(context.Background()) })
	p.probe, err = pgx.Connect(ctx, p.node.DSN(e.db))
	require.NoError(b, err)
	b.Cleanup(func() { _ = p.probe.Close(context.Background()) })
	b.Cleanup(func() { _ = p.node.ResumeReplay(context.Background()) })
	return p
}

// statusQueries is how many replica status queries (the tracker's and
// the publishers' "SELECT r, …") the replica has run in the benchmark's
// database.
func (p *probedReplica) statusQueries(b *testing.B) int64 {
	var n int64
	require.NoError(b, p.stats.QueryRow(context.Background(), `SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements
		WHERE query LIKE 'SELECT r,%' AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&n))
	return n
}

// resumeAndWatch resumes replay and queries pg_last_wal_replay_lsn() in a
// loop until replay has passed every one of lsns; per LSN it returns the
// midpoint of the first query that showed it passed.
func (p *probedReplica) resumeAndWatch(b *testing.B, lsns ...position.LSN) []time.Time {
	ctx := context.Background()
	_, err := p.probe.Exec(ctx, "SELECT pg_wal_replay_resume()")
	require.NoError(b, err)
	passed := make([]time.Time, len(lsns))
	for left := len(lsns); left > 0; {
		var s string
		sent := time.Now()
		require.NoError(b, p.probe.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text").Scan(&s))
		at := sent.Add(time.Since(sent) / 2)
		replayed := position.MustParseLSN(s)
		for i, l := range lsns {
			if passed[i].IsZero() && replayed >= l {
				passed[i] = at
				left--
			}
		}
	}
	return passed
}
