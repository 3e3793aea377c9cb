package consume

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/latency"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// BenchmarkFeedInterval measures what the publishers' interval costs and
// buys, to choose replay.DefaultFeedInterval. For each interval two Publishers
// poll one replica and the primary and a Router takes its positions from
// their feed; it prints a table and asserts nothing about time.
//
//   - replica queries/s: status queries counted by the replica itself
//     (pg_stat_statements) over 5 s, from both publishers and the router
//     (which queries nothing while on the feed);
//   - Redis commands/s over the same 5 s (INFO commandstats), publishers
//     and the router's subscription;
//   - catch-up → wait returns: per job, from the moment a probe looping on
//     its own connection first saw pg_last_wal_replay_lsn() pass the job's
//     token (midpoint of that query) to Route's return, over 300 short
//     replay pauses with one job waiting on the feed. The last rows repeat
//     the default interval without signatures, and with the router polling
//     by itself (WaitPollInterval 5ms), for comparison.
//
// Run it alone: go test -run '^$' -bench FeedInterval -benchtime 1x ./consume/
func BenchmarkFeedInterval(b *testing.B) {
	ctx := context.Background()
	pr := newProbedReplica(b)
	e, node := pr.e, pr.node
	rs, err := pgtest.StartRedis(ctx)
	require.NoError(b, err)
	b.Cleanup(func() { _ = rs.Close() })
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr()})
	defer rdb.Close()
	redisCalls := func() int64 {
		info, err := rdb.Info(ctx, "commandstats").Result()
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
	key, err := feed.GenerateKey("k1")
	require.NoError(b, err)
	dbs := map[string]replay.Database{"main": {Primary: e.primary, Replicas: []replay.Replica{{Name: "r1", Pool: e.replicas[0]}}}}

	type row struct {
		label          string
		qps, redisCmds float64
		lat            []time.Duration
	}
	var rows []row
	measure := func(label string, r *Router) row {
		rw := row{label: label}
		c0, r0, t0 := pr.statusQueries(b), redisCalls(), time.Now()
		time.Sleep(5 * time.Second)
		secs := time.Since(t0).Seconds()
		rw.qps = float64(pr.statusQueries(b)-c0) / secs
		rw.redisCmds = float64(redisCalls()-r0) / secs
		for range 300 {
			require.NoError(b, node.PauseReplay(ctx))
			_, tok := e.write(b)
			var wg sync.WaitGroup
			var returned time.Time
			var d Decision
			wg.Go(func() {
				var err error
				_, d, err = r.Route(ctx, Job{Token: tok, Policy: Delayed})
				returned = time.Now()
				if err != nil {
					b.Errorf("route: %v", err)
				}
			})
			for watchers(r, 0) == 0 {
				time.Sleep(100 * time.Microsecond)
			}
			time.Sleep(20 * time.Millisecond)
			passed := pr.resumeAndWatch(b, tok.Entries[0].LSN)[0]
			wg.Wait()
			if d.Outcome == OutcomeReplicaWaited {
				rw.lat = append(rw.lat, max(returned.Sub(passed), 0))
			}
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
			name := fmt.Sprintf("bench-%v-%v", tc.interval, tc.insecure)
			keys := feed.Keyring{Keys: []feed.Key{key}}
			if tc.insecure {
				keys = feed.Keyring{}
			}
			var pubs []*replay.Publisher
			for _, pn := range []string{"a", "b"} {
				p, err := replay.NewPublisher(ctx, dbs, replay.PublisherConfig{PollInterval: tc.interval,
					Feed: feed.SenderConfig{Client: rdb, Feed: name, Name: pn, Keys: keys, Insecure: tc.insecure}})
				require.NoError(b, err)
				pubs = append(pubs, p)
			}
			r, err := NewRouter(ctx, Config{Databases: dbs, WaitBudget: time.Minute,
				Tracker: replay.TrackerConfig{Feed: &replay.FeedConfig{Client: rdb, Name: name, Keys: keys, Insecure: tc.insecure}},
			})
			require.NoError(b, err)
			for s := r.Tracker().Feed(); !s.Active || s.LocalNodes > 0; s = r.Tracker().Feed() {
				time.Sleep(time.Millisecond)
			}
			label := fmt.Sprintf("feed, 2 publishers every %v", tc.interval)
			if tc.insecure {
				label += ", unsigned"
			}
			rw := measure(label, r)
			if f := r.Tracker().Feed(); f.Fallbacks > 0 {
				rw.label += fmt.Sprintf(" (%d fallbacks)", f.Fallbacks)
			}
			rows = append(rows, rw)
			require.NoError(b, r.Close())
			for _, p := range pubs {
				require.NoError(b, p.Close())
			}
		}
		r, err := NewRouter(ctx, Config{Databases: dbs, WaitBudget: time.Minute})
		require.NoError(b, err)
		rows = append(rows, measure(fmt.Sprintf("no feed: 1 router polling every %v (waiting: %v)", replay.DefaultPollInterval, replay.DefaultWaitPollInterval), r))
		require.NoError(b, r.Close())
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "\n| setup | replica status queries/s (server side) | Redis commands/s | catch-up → wait returns p50 | p90 | p99 | samples |\n|---|---|---|---|---|---|---|\n")
	for _, rw := range rows {
		fmt.Fprintf(&tb, "| %s | %.0f | %.0f | %v | %v | %v | %d |\n", rw.label, rw.qps, rw.redisCmds,
			latency.Percentile(rw.lat, 0.5).Round(100*time.Microsecond), latency.Percentile(rw.lat, 0.9).Round(100*time.Microsecond),
			latency.Percentile(rw.lat, 0.99).Round(100*time.Microsecond), len(rw.lat))
	}
	b.Log(tb.String())
}
