package replay_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Integration tests of the tracker on a position feed: the real cluster,
// a real redis-server, replay.Publishers sending through feed.Senders and
// Trackers subscribed through feed.Subscribers. Waits are on conditions
// with generous deadlines; nothing asserts on time. A read that could be
// stale shows in the tracker's state before any job could make it: a
// replica believed past what it has replayed (HighestReplayed, which
// every usable position raises).

// feedDeadline bounds every wait for a condition.
const feedDeadline = 30 * time.Second

var feedSeq atomic.Int64

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// fleet is one test's database on a cluster, with a table to write to,
// and its feed: its Redis, a unique feed name, a key, and the
// MeterProvider its trackers and subscribers record to.
type fleet struct {
	c        *pgtest.Cluster
	db       string
	primary  *pgxpool.Pool
	replicas []*pgxpool.Pool
	rdb      *redis.Client
	name     string
	keys     feed.Keyring
	reader   *sdkmetric.ManualReader
	mp       *sdkmetric.MeterProvider
}

// newFleet is a fleet on c; redisAddr "" is the shared redis-server.
func newFleet(t testing.TB, c *pgtest.Cluster, redisAddr string) *fleet {
	t.Helper()
	ctx := ctxT(t)
	db := pgtest.NewDatabase(t, c)
	f := &fleet{c: c, db: db}
	var err error
	f.primary, err = c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	t.Cleanup(f.primary.Close)
	_, err = f.primary.Exec(ctx, "CREATE TABLE items (id bigserial PRIMARY KEY, v text)")
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	for _, n := range c.Replicas() {
		p, err := n.Pool(ctx, db)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		f.replicas = append(f.replicas, p)
	}
	if redisAddr == "" {
		redisAddr = pgtest.SharedRedis(t).Addr()
	}
	f.rdb = redis.NewClient(&redis.Options{Addr: redisAddr, DialTimeout: time.Second, ReadTimeout: time.Second, MaxRetries: -1})
	t.Cleanup(func() { _ = f.rdb.Close() })
	k, err := feed.GenerateKey("k1")
	require.NoError(t, err)
	f.keys = feed.Keyring{Keys: []feed.Key{k}}
	name := strings.Map(func(r rune) rune {
		if 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' {
			return r
		}
		return '-'
	}, t.Name())
	f.name = fmt.Sprintf("%.40s.%d", name, feedSeq.Add(1))
	f.reader = sdkmetric.NewManualReader()
	f.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(f.reader))
	t.Cleanup(func() { _ = f.mp.Shutdown(context.Background()) })
	return f
}

// databases is the cluster's replicas named r1, r2, … as trackers and
// publishers name them.
func (f *fleet) databases() map[string]replay.Database {
	reps := make([]replay.Replica, len(f.replicas))
	for i, p := range f.replicas {
		reps[i] = replay.Replica{Name: "r" + strconv.Itoa(i+1), Pool: p}
	}
	return map[string]replay.Database{"main": {Primary: f.primary, Replicas: reps}}
}

// sender is a feed.Sender of the test's feed named name; mods change its
// config. Closed at cleanup.
func (f *fleet) sender(t testing.TB, name string, mods ...func(*feed.SenderConfig)) *feed.Sender {
	t.Helper()
	cfg := feed.SenderConfig{Client: f.rdb, Feed: f.name, Name: name, Keys: f.keys, Logger: logger(t)}
	for _, m := range mods {
		m(&cfg)
	}
	s, err := feed.NewSender(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// publisher starts a replay.Publisher of the test's databases on the
// test's feed, closed at cleanup.
func (f *fleet) publisher(t testing.TB, name string, mods ...func(*feed.SenderConfig, *replay.PublisherConfig)) *replay.Publisher {
	t.Helper()
	return f.publisherOf(t, name, f.databases(), mods...)
}

// publisherOf is publisher for the databases dbs.
func (f *fleet) publisherOf(t testing.TB, name string, dbs map[string]replay.Database, mods ...func(*feed.SenderConfig, *replay.PublisherConfig)) *replay.Publisher {
	t.Helper()
	sc := feed.SenderConfig{Client: f.rdb, Feed: f.name, Name: name, Keys: f.keys, Logger: logger(t)}
	pc := replay.PublisherConfig{Logger: logger(t)}
	for _, m := range mods {
		m(&sc, &pc)
	}
	snd, err := feed.NewSender(sc)
	require.NoError(t, err)
	pc.Feed = snd
	p, err := replay.NewPublisher(ctxT(t), dbs, pc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// source is a feed.Subscriber of the test's feed, recording to the
// fleet's MeterProvider.
func (f *fleet) source(t testing.TB, mods ...func(*feed.SubscriberConfig)) *feed.Subscriber {
	t.Helper()
	cfg := feed.SubscriberConfig{Client: f.rdb, Feed: f.name, Keys: f.keys, MeterProvider: f.mp, Logger: logger(t)}
	for _, m := range mods {
		m(&cfg)
	}
	s, err := feed.NewSubscriber(cfg)
	require.NoError(t, err)
	return s
}

// tracker is a Tracker of the test's databases on the test's feed
// (feed.Subscriber), closed at cleanup; mods change the subscriber's and
// the tracker's configs.
func (f *fleet) tracker(t testing.TB, mods ...func(*feed.SubscriberConfig, *replay.TrackerConfig)) *replay.Tracker {
	t.Helper()
	return f.trackerOf(t, f.databases(), mods...)
}

// trackerOf is tracker for the databases dbs.
func (f *fleet) trackerOf(t testing.TB, dbs map[string]replay.Database, mods ...func(*feed.SubscriberConfig, *replay.TrackerConfig)) *replay.Tracker {
	t.Helper()
	sc := feed.SubscriberConfig{Client: f.rdb, Feed: f.name, Keys: f.keys, MeterProvider: f.mp, Logger: logger(t)}
	tc := replay.TrackerConfig{PollInterval: 50 * time.Millisecond, MeterProvider: f.mp, Logger: logger(t)}
	for _, m := range mods {
		m(&sc, &tc)
	}
	src, err := feed.NewSubscriber(sc)
	require.NoError(t, err)
	fc := replay.FeedConfig{Source: src}
	if tc.Feed != nil {
		fc.SilenceBound, fc.MaxDelay = tc.Feed.SilenceBound, tc.Feed.MaxDelay
	}
	tc.Feed = &fc
	tr, err := replay.NewTracker(ctxT(t), dbs, tc)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, tr.Close()) })
	return tr
}

// waitOnFeed waits until tr takes every node it has identified from the
// feed, polling none itself.
func waitOnFeed(t testing.TB, tr *replay.Tracker) {
	t.Helper()
	require.Eventually(t, func() bool {
		s := tr.Feed()
		return s.Active && s.LocalNodes == 0
	}, feedDeadline, time.Millisecond, "the tracker never took its nodes from the feed")
}

// identified asks tr about its positions (which has it identify its
// replicas) and waits until it has identified every node.
func identified(t testing.TB, tr *replay.Tracker) {
	t.Helper()
	tr.Snapshot()
	require.Eventually(t, func() bool { return tr.Feed().Unidentified == 0 }, feedDeadline, time.Millisecond,
		"the tracker never identified every node")
}

// waitOffFeed waits until tr polls every node itself.
func waitOffFeed(t testing.TB, tr *replay.Tracker) {
	t.Helper()
	n := 0
	for _, db := range tr.Snapshot().Databases {
		n += 1 + len(db.Replicas)
	}
	require.Eventually(t, func() bool {
		s := tr.Feed()
		return !s.Active && s.LocalNodes == n
	}, feedDeadline, time.Millisecond, "the tracker never fell back to its own polls")
}

func (f *fleet) metric(t testing.TB, name string, kv ...attribute.KeyValue) int64 {
	t.Helper()
	return metrictest.Sum(t, f.reader, name, kv...)
}

func (f *fleet) switches(t testing.TB, direction, state string) int64 {
	t.Helper()
	return f.metric(t, "caughtup.consume.feed.switches",
		attribute.String("caughtup.feed.direction", direction), attribute.String("caughtup.feed.state", state))
}

// rejected is caughtup.consume.feed.observations.rejected for reason.
func (f *fleet) rejected(t testing.TB, reason string) int64 {
	t.Helper()
	return f.metric(t, "caughtup.consume.feed.observations.rejected", attribute.String("caughtup.reason", reason))
}

// record subscribes to the feed's channel with a plain Redis client and
// returns the next n messages as sent, to replay or inspect.
func (f *fleet) record(t testing.TB, n int) [][]byte {
	t.Helper()
	ctx := ctxT(t)
	spy := f.rdb.Subscribe(ctx, feed.ChannelName(f.name))
	defer spy.Close()
	var got [][]byte
	for len(got) < n {
		m, err := spy.ReceiveMessage(ctx)
		require.NoError(t, err)
		got = append(got, []byte(m.Payload))
	}
	require.NoError(t, spy.Close())
	return got
}

// write inserts a row and returns its id with the token a producer would
// stamp: the primary's insert position read after COMMIT returned.
func (f *fleet) write(t testing.TB) (int64, position.Token) {
	t.Helper()
	ctx := ctxT(t)
	var id int64
	require.NoError(t, f.primary.QueryRow(ctx, "INSERT INTO items (v) VALUES ('x') RETURNING id").Scan(&id))
	var lsnText, walfile string
	var sys int64
	require.NoError(t, f.primary.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text,
		pg_walfile_name(pg_current_wal_lsn()), (SELECT system_identifier FROM pg_control_system())`).Scan(&lsnText, &walfile, &sys))
	tli, err := strconv.ParseUint(walfile[:8], 16, 32)
	require.NoError(t, err)
	return id, position.New("main", position.Epoch{SystemID: uint64(sys), Timeline: uint32(tli)},
		position.MustParseLSN(lsnText), position.SourcePrimary, time.Now())
}

func pauseAll(t testing.TB, c *pgtest.Cluster) {
	t.Helper()
	for _, n := range c.Replicas() {
		require.NoError(t, n.PauseReplay(ctxT(t)))
	}
	t.Cleanup(func() { resumeAll(t, c) })
}

func resumeAll(t testing.TB, c *pgtest.Cluster) {
	for _, n := range c.Replicas() {
		require.NoError(t, n.ResumeReplay(context.Background()))
	}
}

// waitUntil checks cond on the tracker's snapshot and again on every newer
// one it publishes, until it holds.
func waitUntil(t testing.TB, tr *replay.Tracker, what string, cond func(*replay.Snapshot) bool) *replay.Snapshot {
	t.Helper()
	deadline := time.NewTimer(feedDeadline)
	defer deadline.Stop()
	for {
		s := tr.Snapshot()
		if cond(s) {
			return s
		}
		select {
		case <-s.Changed():
		case <-deadline.C:
			t.Fatalf("gave up waiting until %s; last snapshot %+v; feed %+v", what, s, tr.Feed())
		}
	}
}

// usableAt waits until some replica of tr is usable at tok (fresh, and
// replayed past it), and returns its name.
func usableAt(t testing.TB, tr *replay.Tracker, tok position.Token) string {
	t.Helper()
	e := tok.Entries[0]
	var name string
	waitUntil(t, tr, "a replica is usable at the token", func(s *replay.Snapshot) bool {
		ds := s.Database(e.Database)
		cutoff := time.Now().Add(-tr.Config().StalenessBound)
		for _, rs := range ds.Replicas {
			if rs.Usable(cutoff) && !rs.Held() && e.Compare(rs.Replayed, ds.Primary.History).Status == position.CaughtUp {
				name = rs.Name
				return true
			}
		}
		return false
	})
	return name
}

// replicaQueries sums the polls the tracker sent to replicas.
func replicaQueries(tr *replay.Tracker) uint64 {
	var n uint64
	for _, st := range tr.Stat() {
		if st.Replica != "" {
			n += st.Queries
		}
	}
	return n
}

// believedBelow fails the test if the tracker ever believed a replica at
// or past lsn (HighestReplayed keeps the highest position any usable
// state had).
func believedBelow(t testing.TB, tr *replay.Tracker, lsn position.LSN, replicas ...string) {
	t.Helper()
	for _, rs := range tr.Snapshot().Database("main").Replicas {
		if len(replicas) > 0 && !slices.Contains(replicas, rs.Name) {
			continue
		}
		require.Less(t, rs.HighestReplayed, lsn, "replica %s was believed past its paused position", rs.Name)
	}
}
