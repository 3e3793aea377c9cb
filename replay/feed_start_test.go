package replay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// A fleet started at once (issue 36 §5): a tracker on the feed opens no
// connection to a replica before it is asked about one, and a replica it
// cannot reach stays on the feed's side, neither believed unidentified nor
// polled on schedule, tried again with a growing, jittered backoff.

// viaProxy is a pool to replica i of f's cluster through a fault proxy of
// its own: what the tracker under test connects with.
func viaProxy(t *testing.T, f *fleet, i int) (*fault.Proxy, *pgxpool.Pool) {
	t.Helper()
	proxy, err := fault.NewProxy(fmt.Sprintf("127.0.0.1:%d", f.c.Replicas()[i].Port()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	p, err := pgxpool.New(ctxT(t), fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&connect_timeout=2", proxy.Addr(), f.db))
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return proxy, p
}

func accepted(p *fault.Proxy) int {
	n, _, _ := p.Stats()
	return n
}

// TestFeedStartConnectsNoReplica: a tracker on the feed, its replicas
// behind proxies that count connections, starts and subscribes without a
// single connection to a replica; the first Snapshot has it identify them
// (one connection each), which it closes once the feed covers them.
func TestFeedStartConnectsNoReplica(t *testing.T) {
	t.Parallel()
	f := newFleet(t, pgtest.Shared(t), "")
	f.publisher(t, "pub-a")
	p1, r1 := viaProxy(t, f, 0)
	p2, r2 := viaProxy(t, f, 1)
	dbs := map[string]replay.Database{"main": {Primary: f.primary, Replicas: []replay.Replica{{Name: "r1", Pool: r1}, {Name: "r2", Pool: r2}}}}
	tr := f.trackerOf(t, dbs)
	waitOnFeed(t, tr) // Feed() asks nothing about positions
	// The primary's feed observations flow: the tracker is on the feed.
	require.Eventually(t, func() bool { return f.metric(t, "caughtup.feed.received") > 50 }, feedDeadline, time.Millisecond)
	st := tr.Feed()
	require.Equal(t, 2, st.Unidentified, "%+v", st)
	require.Zero(t, st.LocalNodes)
	require.Zero(t, accepted(p1)+accepted(p2), "the tracker connected to a replica before anyone asked about one")
	require.Zero(t, replicaQueries(tr))
	require.Positive(t, f.rejected(t, "unconfirmed"), "the feed's observations of the unidentified replicas are not believed")
	for _, rs := range tr.Snapshot().Database("main").Replicas { // the demand
		require.False(t, rs.Usable(time.Now().Add(-time.Second)), "replica %s usable before it was identified", rs.Name)
	}

	identified(t, tr)
	_, tok := f.write(t)
	usableAt(t, tr, tok)
	waitOnFeed(t, tr)
	require.Eventually(t, func() bool {
		n := 0
		for _, s := range tr.Stat() {
			n += s.Conns
		}
		return n == 0
	}, feedDeadline, time.Millisecond, "the tracker kept a connection once the feed covered every node")
	a1, a2 := accepted(p1), accepted(p2)
	require.Positive(t, a1)
	require.Positive(t, a2)
	t.Logf("connections to r1, r2 through their proxies: %d, %d (identification, and polls until the feed covered them)", a1, a2)
}

// TestFeedUnreachableReplicaAtStart: the publishers reach both replicas,
// this tracker reaches r1 through a proxy that refuses every connection.
// r1 stays unknown (the feed's word about a run the tracker has not read
// itself is not believed), is not polled on schedule but tried again on a
// growing backoff, and r2 is served by the feed. Once the proxy accepts,
// r1 is identified and taken from the feed.
func TestFeedUnreachableReplicaAtStart(t *testing.T) {
	t.Parallel()
	f := newFleet(t, pgtest.Shared(t), "")
	f.publisher(t, "pub-a")
	f.publisher(t, "pub-b")
	proxy, r1 := viaProxy(t, f, 0)
	proxy.Refuse()
	dbs := map[string]replay.Database{"main": {Primary: f.primary, Replicas: []replay.Replica{{Name: "r1", Pool: r1}, {Name: "r2", Pool: f.replicas[1]}}}}
	tr := f.trackerOf(t, dbs, func(_ *feed.SubscriberConfig, tc *replay.TrackerConfig) {
		tc.PollInterval = 50 * time.Millisecond
		tc.Feed = &replay.FeedConfig{RetryMax: time.Second}
	})
	waitOnFeed(t, tr)
	_, tok := f.write(t)
	require.Equal(t, "r2", usableAt(t, tr, tok), "r2 from the feed")
	require.Eventually(t, func() bool { return accepted(proxy) > 0 }, feedDeadline, time.Millisecond, "the tracker tried r1")

	// Three seconds of refusals: polling on schedule would have tried
	// r1 sixty times; the backoff (50ms doubling to 1s, ±50%) tries it at
	// most a dozen times. A slower machine only tries less.
	a0 := accepted(proxy)
	time.Sleep(3 * time.Second)
	tries := accepted(proxy) - a0
	require.Less(t, tries, 20, "r1 was tried %d times in 3s", tries)
	st := tr.Feed()
	require.Equal(t, 1, st.Unidentified, "%+v", st)
	require.Zero(t, st.LocalNodes, "r1 is not polled on schedule: %+v", st)
	rs := tr.Snapshot().Database("main").Replicas[0]
	require.False(t, rs.Usable(time.Now().Add(-time.Second)), "r1 believed unidentified: %+v", rs)
	require.Zero(t, rs.HighestReplayed, "r1 was never believed at any position")
	require.Positive(t, f.rejected(t, "unconfirmed"))
	t.Logf("r1 tried %d times in 3s of refusals; feed %+v", tries, st)

	proxy.Accept()
	identified(t, tr)
	_, tok = f.write(t)
	waitUntil(t, tr, "r1 usable at the token", func(s *replay.Snapshot) bool {
		r := s.Database("main").Replicas[0]
		return r.Usable(time.Now().Add(-tr.Config().StalenessBound)) && r.Replayed.LSN >= tok.Entries[0].LSN
	})
	waitOnFeed(t, tr)
}

// TestFeedKeepsIdentifiedReplicaWhileUnreachable: a replica the tracker
// identified, then cannot reach while the feed is silent (its polls fail
// and back off), is taken from the feed again as soon as the feed covers
// it, although the tracker still cannot reach it.
func TestFeedKeepsIdentifiedReplicaWhileUnreachable(t *testing.T) {
	t.Parallel()
	f := newFleet(t, pgtest.Shared(t), "")
	pub := f.publisher(t, "pub-a")
	proxy, r1 := viaProxy(t, f, 0)
	dbs := map[string]replay.Database{"main": {Primary: f.primary, Replicas: []replay.Replica{{Name: "r1", Pool: r1}, {Name: "r2", Pool: f.replicas[1]}}}}
	tr := f.trackerOf(t, dbs, func(_ *feed.SubscriberConfig, tc *replay.TrackerConfig) {
		tc.Feed = &replay.FeedConfig{RetryMax: time.Second}
	})
	waitOnFeed(t, tr)
	identified(t, tr)

	// The feed falls silent and r1 refuses: the tracker polls every node
	// itself, and r1's polls fail.
	proxy.Refuse()
	proxy.Cut()
	require.NoError(t, pub.Close())
	waitOffFeed(t, tr)
	waitUntil(t, tr, "r1 unreadable", func(s *replay.Snapshot) bool { return s.Database("main").Replicas[0].Err != nil })

	// A publisher again: r1 comes from the feed, unreachable as it is.
	f.publisher(t, "pub-b")
	_, tok := f.write(t)
	waitUntil(t, tr, "r1 usable at the token from the feed", func(s *replay.Snapshot) bool {
		r := s.Database("main").Replicas[0]
		return r.Usable(time.Now().Add(-tr.Config().StalenessBound)) && r.Replayed.LSN >= tok.Entries[0].LSN
	})
	waitOnFeed(t, tr)
	a0 := accepted(proxy)
	time.Sleep(time.Second)
	require.Zero(t, accepted(proxy)-a0, "the tracker tried r1 while the feed covered it")
}
