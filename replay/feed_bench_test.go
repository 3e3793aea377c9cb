package replay_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/latency"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// BenchmarkFeedInterval measures what the publishers' interval costs and
// buys, to choose replay.DefaultFeedInterval. For each interval two
// Publishers poll one replica and the primary and a Tracker takes its
// positions from their feed; it prints a table and asserts nothing about
// time.
//
//   - replica queries/s: status queries counted by the replica itself
//     (pg_stat_statements) over 5 s, from both publishers and the tracker
//     (which queries nothing while on the feed);
//   - Redis commands/s over the same 5 s (INFO commandstats), publishers
//     and the tracker's subscription;
//   - catch-up → tracker knows: per trial, from the moment a probe looping
//     on its own connection first saw pg_last_wal_replay_lsn() pass a
//     write's token (midpoint of that query) to the first snapshot that
//     shows the replica past it, over 300 short replay pauses while a
//     caller watches the replica (Watch, as a waiting job does). The last
//     rows repeat the default interval without signatures, and with the
//     tracker polling by itself (WaitPollInterval 5ms), for comparison.
//
// Run it alone: go test -run '^$' -bench FeedInterval -benchtime 1x ./replay/
func BenchmarkFeedInterval(b *testing.B) {
	ctx := context.Background()
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1, Settings: map[string]string{
		"shared_preload_libraries": "'pg_stat_statements'",
	}})
	require.NoError(b, err)
	b.Cleanup(func() { _ = c.Close() })
	rs, err := pgtest.StartRedis(ctx)
	require.NoError(b, err)
	b.Cleanup(func() { _ = rs.Close() })
	f := newFleet(b, c, rs.Addr())
	_, err = f.primary.Exec(ctx, "CREATE EXTENSION pg_stat_statements")
	require.NoError(b, err)
	require.NoError(b, c.WaitReplicasCaughtUp(ctx))
	node := c.Replicas()[0]
	db := f.replicas[0].Config().ConnConfig.Database
	stats, err := pgx.Connect(ctx, node.DSN(db))
	require.NoError(b, err)
	b.Cleanup(func() { _ = stats.Close(context.Background()) })
	probe, err := pgx.Connect(ctx, node.DSN(db))
	require.NoError(b, err)
	b.Cleanup(func() { _ = probe.Close(context.Background()) })
	b.Cleanup(func() { _ = node.ResumeReplay(context.Background()) })
	statusQueries := func() int64 {
		var n int64
		require.NoError(b, stats.QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements
			WHERE query LIKE 'SELECT r,%' AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&n))
		return n
	}
	redisCalls := func() int64 {
		info, err := f.rdb.Info(ctx, "commandstats").Result()
		require.NoError(b, err)
		var total int64
		for line := range strings.SplitSeq(info, "\n") {
			if _, rest, ok := strings.Cut(line, "calls="); ok {
				n, _ := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
				total += n
			}
		}
		return total
	}
	// resumeAndWatch resumes replay and returns the midpoint of the first
	// probe query that saw replay pass lsn.
	resumeAndWatch := func(lsn position.LSN) time.Time {
		_, err := probe.Exec(ctx, "SELECT pg_wal_replay_resume()")
		require.NoError(b, err)
		for {
			var s string
			sent := time.Now()
			require.NoError(b, probe.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text").Scan(&s))
			if position.MustParseLSN(s) >= lsn {
				return sent.Add(time.Since(sent) / 2)
			}
		}
	}
	dbs := f.databases()

	type row struct {
		label          string
		qps, redisCmds float64
		lat            []time.Duration
	}
	var rows []row
	measure := func(label string, tr *replay.Tracker) row {
		rw := row{label: label}
		c0, r0, t0 := statusQueries(), redisCalls(), time.Now()
		time.Sleep(5 * time.Second)
		secs := time.Since(t0).Seconds()
		rw.qps = float64(statusQueries()-c0) / secs
		rw.redisCmds = float64(redisCalls()-r0) / secs
		for range 300 {
			require.NoError(b, node.PauseReplay(ctx))
			_, tok := f.write(b)
			stop := tr.Watch("main")
			time.Sleep(20 * time.Millisecond)
			knew := make(chan time.Time, 1)
			go func() {
				waitUntil(b, tr, "the replica is seen at the token", func(s *replay.Snapshot) bool {
					return s.Database("main").Replicas[0].Replayed.LSN >= tok.Entries[0].LSN
				})
				knew <- time.Now()
			}()
			passed := resumeAndWatch(tok.Entries[0].LSN)
			rw.lat = append(rw.lat, max((<-knew).Sub(passed), 0))
			stop()
		}
		return rw
	}
	for b.Loop() {
		rows = rows[:0]
		for _, tc := range []struct {
			interval time.Duration
			insecure bool
		}{{5 * time.Millisecond, false}, {10 * time.Millisecond, false}, {20 * time.Millisecond, false},
			{50 * time.Millisecond, false}, {replay.DefaultFeedInterval, true}} {
			keys := f.keys
			if tc.insecure {
				keys = feed.Keyring{}
			}
			name := fmt.Sprintf("bench-%v-%v", tc.interval, tc.insecure)
			var pubs []*replay.Publisher
			for _, pn := range []string{"a", "b"} {
				snd, err := feed.NewSender(feed.SenderConfig{Client: f.rdb, Feed: name, Name: pn, Keys: keys, Insecure: tc.insecure})
				require.NoError(b, err)
				p, err := replay.NewPublisher(ctx, dbs, replay.PublisherConfig{PollInterval: tc.interval, Feed: snd})
				require.NoError(b, err)
				pubs = append(pubs, p)
			}
			src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: f.rdb, Feed: name, Keys: keys, Insecure: tc.insecure})
			require.NoError(b, err)
			tr, err := replay.NewTracker(ctx, dbs, replay.TrackerConfig{Feed: &replay.FeedConfig{Source: src}})
			require.NoError(b, err)
			for s := tr.Feed(); !s.Active || s.LocalNodes > 0; s = tr.Feed() {
				time.Sleep(time.Millisecond)
			}
			label := fmt.Sprintf("feed, 2 publishers every %v", tc.interval)
			if tc.insecure {
				label += ", unsigned"
			}
			rw := measure(label, tr)
			if s := tr.Feed(); s.Fallbacks > 0 {
				rw.label += fmt.Sprintf(" (%d fallbacks)", s.Fallbacks)
			}
			rows = append(rows, rw)
			require.NoError(b, tr.Close())
			for _, p := range pubs {
				require.NoError(b, p.Close())
			}
		}
		tr, err := replay.NewTracker(ctx, dbs, replay.TrackerConfig{})
		require.NoError(b, err)
		rows = append(rows, measure(fmt.Sprintf("no feed: 1 tracker polling every %v (watched: %v)", replay.DefaultPollInterval, replay.DefaultWaitPollInterval), tr))
		require.NoError(b, tr.Close())
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "\n| setup | replica status queries/s (server side) | Redis commands/s | catch-up → tracker knows p50 | p90 | p99 | samples |\n|---|---|---|---|---|---|---|\n")
	for _, rw := range rows {
		fmt.Fprintf(&tb, "| %s | %.0f | %.0f | %v | %v | %v | %d |\n", rw.label, rw.qps, rw.redisCmds,
			latency.Percentile(rw.lat, 0.5).Round(100*time.Microsecond), latency.Percentile(rw.lat, 0.9).Round(100*time.Microsecond),
			latency.Percentile(rw.lat, 0.99).Round(100*time.Microsecond), len(rw.lat))
	}
	b.Log(tb.String())
}
