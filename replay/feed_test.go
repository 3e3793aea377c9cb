package replay_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// privateCluster is a cluster of the test's own, for tests that restart
// or kill its nodes.
func privateCluster(t *testing.T) *pgtest.Cluster {
	t.Helper()
	c, err := pgtest.Start(ctxT(t), pgtest.Options{Replicas: 2, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

// TestFeedWakesWaiters: a caller watching a paused replica learns from a
// feed message that replay resumed, and the watch does not make the
// tracker poll: the publishers set the pace.
func TestFeedWakesWaiters(t *testing.T) {
	c := pgtest.Shared(t)
	f := newFleet(t, c, "")
	f.publisher(t, "pub-a")
	tr := f.tracker(t)
	identified(t, tr)
	waitOnFeed(t, tr)
	pauseAll(t, c)
	_, tok := f.write(t)
	stop := tr.Watch("main")
	defer stop()
	before, q0 := tr.Feed(), replicaQueries(tr)
	seq0 := tr.Snapshot().Seq
	// Feed messages keep arriving while it waits.
	waitUntil(t, tr, "ten more feed observations", func(s *replay.Snapshot) bool { return s.Seq > seq0+10 })
	believedBelow(t, tr, tok.Entries[0].LSN)
	resumeAll(t, c)
	usableAt(t, tr, tok)
	after, q1 := tr.Feed(), replicaQueries(tr)
	if after.Fallbacks == before.Fallbacks && after.Active {
		// On the feed throughout: the wait cost the replicas nothing.
		require.Equal(t, q0, q1, "the tracker queried the replicas while on the feed")
	} else {
		t.Logf("the tracker fell back during the wait (%+v → %+v); its queries are not checked", before, after)
	}
}

// TestFeedFallbackAndBack: silence (every publisher stopped), a dropped
// subscription and a Redis restart each send the tracker to its own polls,
// which keep its replicas known, and it returns to the feed when the feed
// recovers. Each switch is counted.
func TestFeedFallbackAndBack(t *testing.T) {
	t.Parallel()
	rs, err := pgtest.StartRedis(ctxT(t))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, rs.Close()) })
	f := newFleet(t, pgtest.Shared(t), rs.Addr())
	pub := f.publisher(t, "pub-a")
	tr := f.tracker(t)
	waitOnFeed(t, tr)
	require.EqualValues(t, 1, f.switches(t, "to_feed", "subscribed"))

	known := func(what string) {
		t.Helper()
		_, tok := f.write(t)
		require.NotEmpty(t, usableAt(t, tr, tok), what)
	}
	known("on the feed")

	// Every publisher stops: the feed falls silent.
	require.NoError(t, pub.Close())
	waitOffFeed(t, tr)
	// Nodes go to local polls on their own silence bound; the switch of
	// the whole feed follows when the subscriber reports the silence.
	require.Eventually(t, func() bool { return f.switches(t, "to_local", "silent") == 1 }, feedDeadline, time.Millisecond)
	known("feed silent")
	f.publisher(t, "pub-b")
	require.Eventually(t, func() bool { return f.switches(t, "to_feed", "subscribed") == 2 }, feedDeadline, time.Millisecond)
	waitOnFeed(t, tr)
	known("feed back")

	// The subscription is dropped by the server.
	require.NoError(t, f.rdb.Do(ctxT(t), "CLIENT", "KILL", "TYPE", "pubsub").Err())
	require.Eventually(t, func() bool { return f.switches(t, "to_local", "dropped") == 1 }, feedDeadline, time.Millisecond)
	require.Eventually(t, func() bool { return f.switches(t, "to_feed", "subscribed") == 3 }, feedDeadline, time.Millisecond)
	waitOnFeed(t, tr)

	// Redis stops: the tracker polls by itself; it comes back when Redis
	// does.
	require.NoError(t, rs.Stop())
	waitOffFeed(t, tr)
	known("Redis down")
	require.NoError(t, rs.Start(ctxT(t)))
	require.Eventually(t, func() bool { return f.switches(t, "to_feed", "subscribed") == 4 }, feedDeadline, time.Millisecond)
	waitOnFeed(t, tr)
	known("Redis back")
	// Every switch away from the feed was followed by one back.
	toLocal := f.metric(t, "caughtup.consume.feed.switches", attribute.String("caughtup.feed.direction", "to_local"))
	require.EqualValues(t, 3, toLocal)
	require.EqualValues(t, 1, f.switches(t, "to_local", "silent"))
}

// TestFeedRejectsForgedUnsignedReplayedImpossible injects messages with
// plain Redis clients while replay is paused: none of them moves a
// replica past its paused position, and each is counted by its reason.
func TestFeedRejectsForgedUnsignedReplayedImpossible(t *testing.T) {
	c := pgtest.Shared(t)
	f := newFleet(t, c, "")
	f.publisher(t, "pub-a")
	tr := f.tracker(t)
	waitOnFeed(t, tr)
	identified(t, tr) // every node is known before the attack

	// Capture authentic messages with a plain subscriber, to replay.
	ctx := ctxT(t)
	captured := f.record(t, 5)

	pauseAll(t, c)
	_, tok := f.write(t)
	claim := tok.Entries[0].LSN + 1<<20 // "caught up", and more
	snap := tr.Snapshot().Database("main")
	incs := make([]replay.Incarnation, len(snap.Replicas))
	for i, rs := range snap.Replicas {
		incs[i] = rs.Incarnation
	}
	epoch := tok.Entries[0].Epoch
	claims := func(pub *feed.Sender, n int, inc func(i int) replay.Incarnation) {
		for range n {
			for i := range incs {
				in := inc(i)
				require.NoError(t, pub.Publish(feed.Observation{Database: "main", Node: fmt.Sprintf("r%d", i+1), Role: feed.RoleReplica,
					Replica: feed.ReplicaStatus{InRecovery: true, Replayed: claim, Epoch: epoch,
						Incarnation: in.PostmasterStart, RecoveryStart: in.RecoveryStart}}))
				require.NoError(t, pub.Flush(ctx))
			}
		}
	}
	attacker := func(keys feed.Keyring, insecure bool) *feed.Sender {
		// TTL 1ms: their stored values are gone before any resubscription
		// could read them again.
		return f.sender(t, "attacker", func(sc *feed.SenderConfig) {
			sc.Keys, sc.Insecure, sc.TTL = keys, insecure, time.Millisecond
		})
	}
	wrongSecret, err := feed.GenerateKey("k1")
	require.NoError(t, err)
	otherKey, err := feed.GenerateKey("k9")
	require.NoError(t, err)
	current := func(i int) replay.Incarnation { return incs[i] }

	const n = 10
	claims(attacker(feed.Keyring{Keys: []feed.Key{wrongSecret}}, false), n, current) // forged: bad signature
	claims(attacker(feed.Keyring{Keys: []feed.Key{otherKey}}, false), n, current)    // a key the tracker lacks
	claims(attacker(feed.Keyring{}, true), n, current)                               // unsigned
	for _, b := range captured {                                                     // replayed
		require.NoError(t, f.rdb.Publish(ctx, feed.ChannelName(f.name), b).Err())
	}
	for range n { // garbage
		require.NoError(t, f.rdb.Publish(ctx, feed.ChannelName(f.name), "\x01FFFFFFFF/FFFFFFFF").Err())
	}
	// Authentic but impossible: past the primary's insert position.
	claims(attacker(f.keys, false), n, current)
	// Authentic, of an earlier run of each replica: superseded.
	claims(attacker(f.keys, false), n, func(i int) replay.Incarnation {
		in := incs[i]
		in.PostmasterStart = in.PostmasterStart.Add(-time.Hour)
		return in
	})

	rejected := func(reason string) int64 {
		return metrictest.Sum(t, f.reader, "caughtup.feed.rejected", attribute.String("caughtup.reason", reason))
	}
	want := map[string]int64{"bad_signature": 2 * n, "unknown_key": 2 * n, "unsigned": 2 * n, "replayed": int64(len(captured)), "malformed": n}
	superseded := func() int64 { return f.rejected(t, "superseded") }
	require.Eventually(t, func() bool {
		for reason, w := range want {
			if rejected(reason) < w {
				return false
			}
		}
		return superseded() >= 2*n
	}, feedDeadline, time.Millisecond, func() string {
		got := map[string]int64{"superseded": superseded()}
		for reason := range want {
			got[reason] = rejected(reason)
		}
		return fmt.Sprintf("rejections %v, want %v and superseded %d", got, want, 2*n)
	}())
	for reason, w := range want {
		require.Equal(t, w, rejected(reason), reason)
	}
	// The impossible claims were held, then found impossible (or dropped
	// unverified): none was merged as a position.
	var impossible, unverified int64
	require.Eventually(t, func() bool {
		impossible = f.metric(t, "caughtup.consume.tracker.observations.rejected", attribute.String("caughtup.reason", "impossible"))
		unverified = f.rejected(t, "unverified")
		return impossible+unverified >= 2*n
	}, feedDeadline, time.Millisecond)
	believedBelow(t, tr, tok.Entries[0].LSN)
	t.Logf("impossible %d, unverified %d; feed %+v", impossible, unverified, tr.Feed())
}

// TestFeedOldRunAndSwappedNamesNotBelieved: after a replica restarts, an
// authentic message of its earlier run (recorded before the restart, or
// crafted with the key) is superseded, not believed; and a publisher that
// calls the replicas by each other's names never makes the one that lacks
// a write look as if it had it.
func TestFeedOldRunAndSwappedNamesNotBelieved(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	f := newFleet(t, c, "")
	ctx := ctxT(t)
	node1, node2 := c.Replicas()[0], c.Replicas()[1]

	// Messages of publisher A about the replicas' first runs, recorded.
	pubA := f.publisher(t, "pub-a")
	recorded := f.record(t, 30)
	before := pubA.Snapshot().Database("main").Replicas[0]
	require.NoError(t, pubA.Close())

	// r1 restarts. A tracker that starts now identifies it before it
	// believes the feed about it.
	require.NoError(t, node1.Stop(ctx))
	require.NoError(t, node1.Start(ctx))
	f.publisher(t, "pub-b")
	tr := f.tracker(t)
	waitOnFeed(t, tr)
	identified(t, tr)
	after := tr.Snapshot().Database("main").Replicas[0]
	require.Equal(t, 1, after.Incarnation.Compare(before.Incarnation), "the restart gave r1 a newer run")

	// r1 stops replaying; r2 has the row.
	require.NoError(t, node1.PauseReplay(ctx))
	t.Cleanup(func() { _ = node1.ResumeReplay(context.Background()) })
	_, tok := f.write(t)
	lsnText, err := node1.ReplayLSN(ctx)
	require.NoError(t, err)
	require.Less(t, position.MustParseLSN(lsnText), tok.Entries[0].LSN)
	require.NoError(t, node2.WaitReplay(ctx, tok.Entries[0].LSN.String()))

	superseded := func() int64 { return f.rejected(t, "superseded") }
	delayed := func() int64 { return f.rejected(t, "delayed") }
	// The recorded messages, replayed: this tracker never heard of their
	// publisher, so the feed package delivers them; they are of r1's
	// earlier run (superseded) or sent too long ago (delayed).
	s0, d0 := superseded(), delayed()
	for _, b := range recorded {
		require.NoError(t, f.rdb.Publish(ctx, feed.ChannelName(f.name), b).Err())
	}
	// Authentic, sent now, of r1's earlier run, claiming the row.
	crafted := f.sender(t, "pub-a", func(sc *feed.SenderConfig) { sc.TTL = time.Millisecond })
	const n = 10
	for range n {
		require.NoError(t, crafted.Publish(feed.Observation{Database: "main", Node: "r1", Role: feed.RoleReplica,
			Replica: feed.ReplicaStatus{InRecovery: true, Replayed: tok.Entries[0].LSN + 1<<20, Epoch: tok.Entries[0].Epoch,
				Incarnation: before.Incarnation.PostmasterStart, RecoveryStart: before.Incarnation.RecoveryStart}}))
		require.NoError(t, crafted.Flush(ctx))
	}
	require.Eventually(t, func() bool { return superseded()-s0 >= n }, feedDeadline, time.Millisecond)
	t.Logf("%d recorded messages replayed: %d rejected by the feed package as replays (it read publisher A's stored values when it subscribed), %d superseded, %d delayed",
		len(recorded), metrictest.Sum(t, f.reader, "caughtup.feed.rejected", attribute.String("caughtup.reason", "replayed")),
		superseded()-s0-n, delayed()-d0)
	believedBelow(t, tr, tok.Entries[0].LSN, "r1")

	// A publisher that swaps the replicas' names: its "r1" is r2 (which
	// has the row) and its "r2" is r1 (which lacks it).
	s1 := superseded()
	f.publisherOf(t, "pub-swapped", map[string]replay.Database{"main": {Primary: f.primary, Replicas: []replay.Replica{
		{Name: "r1", Pool: f.replicas[1]}, {Name: "r2", Pool: f.replicas[0]}}}})
	require.Eventually(t, func() bool {
		return superseded()-s1+f.rejected(t, "mismatch") >= 2*n
	}, feedDeadline, time.Millisecond)
	believedBelow(t, tr, tok.Entries[0].LSN, "r1")
	t.Logf("feed %+v", tr.Feed())
}

// TestFeedConfigValidation: the tracker checks its part of a feed's
// configuration; the Redis source checks its own (feed.NewSubscriber).
func TestFeedConfigValidation(t *testing.T) {
	t.Parallel()
	src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: nil, Insecure: true})
	require.ErrorIs(t, err, feed.ErrInvalidConfig, "no Redis client")
	require.Nil(t, src)
	valid := func(fc *replay.FeedConfig) error {
		return replay.TrackerConfig{Feed: fc}.WithDefaults().Validate()
	}
	require.ErrorIs(t, valid(&replay.FeedConfig{}), replay.ErrInvalidConfig, "no Source")
	require.ErrorContains(t, valid(&replay.FeedConfig{}), "Source")
	s := stubSource{}
	cfg := replay.TrackerConfig{Feed: &replay.FeedConfig{Source: s}}.WithDefaults()
	require.NoError(t, cfg.Validate())
	require.Equal(t, replay.DefaultStalenessBound/2, cfg.Feed.SilenceBound)
	require.Equal(t, replay.DefaultFeedMaxDelay, cfg.Feed.MaxDelay)
	require.ErrorContains(t, valid(&replay.FeedConfig{Source: s, SilenceBound: 2 * time.Second}), "SilenceBound")
	require.ErrorIs(t, valid(&replay.FeedConfig{Source: s, SilenceBound: -1}), replay.ErrInvalidConfig)
}

// stubSource is a FeedSource for configuration checks only.
type stubSource struct{}

func (stubSource) Subscribe(context.Context, replay.FeedHandler) error { return nil }
func (stubSource) Destination() string                                 { return "stub" }

// TestFeedInsecureIsLogged: a source that believes unsigned messages says
// so when it is made, and a tracker on it works with an unsigned
// publisher.
func TestFeedInsecureIsLogged(t *testing.T) {
	t.Parallel()
	f := newFleet(t, pgtest.Shared(t), "")
	var logs syncBuffer
	tr := f.tracker(t, func(sc *feed.SubscriberConfig, _ *replay.TrackerConfig) {
		sc.Keys, sc.Insecure = feed.Keyring{}, true
		sc.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	require.Contains(t, logs.String(), "authentication OFF")
	f.publisher(t, "pub-insecure", func(sc *feed.SenderConfig, _ *replay.PublisherConfig) { sc.Keys, sc.Insecure = feed.Keyring{}, true })
	waitOnFeed(t, tr)
	_, tok := f.write(t)
	usableAt(t, tr, tok)
	require.Positive(t, metrictest.Sum(t, f.reader, "caughtup.feed.received"))
}

// TestFeedKeyRotation: trackers hold the old and the new key; the
// publishers switch from one to the other (a new publisher signs with the
// new key, then the old one stops). The tracker stays on the feed and
// rejects nothing.
func TestFeedKeyRotation(t *testing.T) {
	t.Parallel()
	f := newFleet(t, pgtest.Shared(t), "")
	k2, err := feed.GenerateKey("k2")
	require.NoError(t, err)
	both := feed.Keyring{Keys: []feed.Key{f.keys.Keys[0], k2}}
	old := f.publisher(t, "pub-old", func(sc *feed.SenderConfig, _ *replay.PublisherConfig) { sc.Keys = both }) // signs with k1, the first
	tr := f.tracker(t, func(sc *feed.SubscriberConfig, _ *replay.TrackerConfig) { sc.Keys = both })
	waitOnFeed(t, tr)
	f.publisher(t, "pub-new", func(sc *feed.SenderConfig, _ *replay.PublisherConfig) {
		sc.Keys = feed.Keyring{Keys: both.Keys, Current: "k2"}
	})
	received := func() int64 { return metrictest.Sum(t, f.reader, "caughtup.feed.received") }
	n0 := received()
	require.NoError(t, old.Close())
	require.Eventually(t, func() bool { return received() > n0+100 }, feedDeadline, time.Millisecond)
	require.True(t, tr.Feed().Active)
	require.Zero(t, metrictest.Sum(t, f.reader, "caughtup.feed.rejected"), "nothing rejected during the rotation")
	_, tok := f.write(t)
	usableAt(t, tr, tok)
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
