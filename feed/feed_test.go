package feed_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

var epoch = position.Epoch{SystemID: 7412345678901234567, Timeline: 1}

func replica(node string, lsn position.LSN) feed.Observation {
	return feed.Observation{Database: "main", Node: node, Role: feed.RoleReplica,
		Replica: feed.ReplicaStatus{InRecovery: true, Replayed: lsn, Epoch: epoch,
			Incarnation: time.Date(2025, 6, 1, 0, 0, 0, 0, time.UTC)}}
}

func primary(lsn position.LSN) feed.Observation {
	return feed.Observation{Database: "main", Node: "pg-0", Role: feed.RolePrimary,
		Primary: feed.PrimaryStatus{Epoch: epoch, InsertLSN: lsn, HistoryKnown: true,
			WAL: position.WALLayout{MaxAlign: 8, BlockSize: 8192, SegmentSize: 16 << 20}}}
}

func TestRoundTrip(t *testing.T) {
	t.Parallel()
	name, k := feedName(t), key(t, "k1")
	s := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: feed.Keyring{Keys: []feed.Key{k}}})
	require.Equal(t, []feed.State{feed.StateSubscribed}, s.waitState(t, feed.StateSubscribed))

	p, pm := startPublisher(t, feed.SenderConfig{Feed: name, Name: "feed-a", Keys: feed.Keyring{Keys: []feed.Key{k}}})
	r := replica("replica-1", 0x16B374D000)
	r.PolledAt = time.Now().Add(-5 * time.Millisecond)
	r.Replica.ReplayTimestamp = time.Date(2025, 6, 1, 12, 0, 0, 123456000, time.UTC)
	r.Replica.TimeLag = 1500 * time.Microsecond
	pr := primary(0x16B374D848)
	pr.Primary.History = position.History{{Timeline: 1, Switchpoint: 0x3000060}}
	publish(t, p, r, pr)

	got := map[feed.Role]feed.Delivery{}
	for range 2 {
		d := s.next(t)
		got[d.Role] = d
	}
	for _, want := range []feed.Observation{r, pr} {
		d := got[want.Role]
		require.Equal(t, p.ID(), d.Publisher)
		require.Equal(t, "k1", d.KeyID)
		require.False(t, d.Stored)
		require.Equal(t, d.Held, d.Age, "a live message's age is what the publisher held it")
		require.Equal(t, d.ReceivedAt.Add(-d.Age), d.PolledAt)
		d.FeedObservation.PolledAt = want.PolledAt
		require.Equal(t, want, d.FeedObservation)
	}
	require.GreaterOrEqual(t, got[feed.RoleReplica].Held, 5*time.Millisecond, "PolledAt 5ms before Publish")
	require.NotEqual(t, got[feed.RoleReplica].Seq, got[feed.RolePrimary].Seq)
	require.Equal(t, int64(2), pm.sum(t, "caughtup.feed.published"))
	require.Equal(t, int64(2), s.metrics.sum(t, "caughtup.feed.received", attribute.String("caughtup.feed.source", "live")))

	// A subscriber that comes later reads the stored values, with their
	// age measured by Redis.
	late := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: feed.Keyring{Keys: []feed.Key{k}}})
	for range 2 {
		d := late.next(t)
		require.True(t, d.Stored)
		require.GreaterOrEqual(t, d.Age, d.Held)
		require.Less(t, d.Age, 10*time.Second+d.Held, "age within the TTL")
		require.Equal(t, got[d.Role].Seq, d.Seq)
	}
	late.waitState(t, feed.StateSubscribed)
	require.Equal(t, int64(2), late.metrics.sum(t, "caughtup.feed.received", attribute.String("caughtup.feed.source", "stored")))
	require.Zero(t, late.metrics.sum(t, "caughtup.feed.rejected"))
}

// TestSeveralPublishers: every message of three concurrent publishers is
// delivered once, in each publisher's order.
func TestSeveralPublishers(t *testing.T) {
	t.Parallel()
	name, k := feedName(t), key(t, "k1")
	s := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: feed.Keyring{Keys: []feed.Key{k}}})
	s.waitState(t, feed.StateSubscribed)

	const n = 200
	var pubs []*feed.Sender
	var pms []*metrics
	for i := range 3 {
		p, m := startPublisher(t, feed.SenderConfig{Feed: name, Name: fmt.Sprintf("feed-%d", i), Keys: feed.Keyring{Keys: []feed.Key{k}}})
		pubs, pms = append(pubs, p), append(pms, m)
	}
	errs := make(chan error, len(pubs))
	for _, p := range pubs {
		go func() {
			for j := 1; j <= n; j++ {
				for _, node := range []string{"r1", "r2"} {
					if err := p.Publish(replica(node, position.LSN(j))); err != nil {
						errs <- err
						return
					}
				}
			}
			errs <- p.Flush(context.Background())
		}()
	}
	for range pubs {
		require.NoError(t, <-errs)
	}
	// Newer observations replace waiting ones, so fewer than 2n may go
	// out; every one that went out arrives.
	var published int64
	for _, m := range pms {
		published += m.sum(t, "caughtup.feed.published")
	}
	type stream struct {
		pub  feed.PublisherID
		node string
	}
	last := map[stream]feed.Delivery{}
	for range published {
		d := s.next(t)
		st := stream{d.Publisher, d.Node}
		if prev, ok := last[st]; ok {
			require.Greater(t, d.Seq, prev.Seq)
			require.GreaterOrEqual(t, d.Replica.Replayed, prev.Replica.Replayed)
		}
		last[st] = d
	}
	s.none(t)
	require.Len(t, last, 6)
	for st, d := range last {
		require.Equal(t, position.LSN(n), d.Replica.Replayed, "%v: the last observation arrives", st)
	}
	require.Zero(t, s.metrics.sum(t, "caughtup.feed.rejected"))
	require.Equal(t, published, s.metrics.sum(t, "caughtup.feed.received"))
}

// TestRejects injects every kind of bad message with plain clients: each
// is counted under its reason, none is delivered, and the counts equal
// what was injected.
func TestRejects(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	name, k1 := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k1}}
	s := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: ring})
	s.waitState(t, feed.StateSubscribed)

	// A plain client records the authentic messages, to replay them.
	spy := client(t, nil).Subscribe(ctx, feed.ChannelName(name))
	defer spy.Close()
	_, err := spy.Receive(ctx)
	require.NoError(t, err)

	honest, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "honest", Keys: ring})
	const authentic = 20
	for i := 1; i <= authentic; i++ {
		publish(t, honest, replica("r1", position.LSN(i)))
	}
	var recorded []string
	for range authentic {
		msg, err := spy.ReceiveMessage(ctx)
		require.NoError(t, err)
		recorded = append(recorded, msg.Payload)
		d := s.next(t)
		require.Equal(t, "honest", d.Publisher.Name)
	}

	// The bad ones. Each claims a caught-up replica.
	caughtUp := position.LSN(0xFFFFFFFFFFFFFFFF)
	inject := func(p *feed.Sender, n int) {
		for i := range n {
			require.NoError(t, p.Publish(replica(fmt.Sprintf("evil-%d", i), caughtUp)))
		}
		require.NoError(t, p.Flush(ctx))
	}
	forged := k1
	forged.Secret = key(t, "k1").Secret // the right ID, the wrong secret
	forger, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "forger", Keys: feed.Keyring{Keys: []feed.Key{forged}}})
	unsigned, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "unsigned", Insecure: true})
	stranger, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "stranger", Keys: feed.Keyring{Keys: []feed.Key{key(t, "k9")}}})
	otherFeed, _ := startPublisher(t, feed.SenderConfig{Feed: name + "x", Name: "other", Keys: ring})
	inject(forger, 50)
	inject(unsigned, 40)
	inject(stranger, 30)

	plain := client(t, nil)
	ch := feed.ChannelName(name)
	pub := func(payload any) { require.NoError(t, plain.Publish(ctx, ch, payload).Err()) }
	// Another feed's message, signed with the same key, re-published here.
	otherSpy := client(t, nil).Subscribe(ctx, feed.ChannelName(name+"x"))
	defer otherSpy.Close()
	_, err = otherSpy.Receive(ctx)
	require.NoError(t, err)
	inject(otherFeed, 10)
	for range 10 {
		msg, err := otherSpy.ReceiveMessage(ctx)
		require.NoError(t, err)
		pub(msg.Payload)
	}
	// Replays: every authentic message again, old and latest.
	for _, m := range recorded {
		pub(m)
	}
	// Malformed: garbage, truncations and trailing bytes of authentic ones.
	rnd := rand.New(rand.NewPCG(1, 2))
	var malformed int
	for i := range 25 {
		b := make([]byte, 1+rnd.IntN(200))
		for j := range b {
			b[j] = byte(rnd.Uint32())
		}
		b[0] = 1 // past the version check
		pub(b)
		pub(recorded[i%authentic][:len(recorded[i%authentic])-1-i])
		pub(recorded[i%authentic] + "x")
		malformed += 3
	}
	// A future format version.
	for _, m := range recorded[:5] {
		pub("\x02" + m[1:])
	}
	// An authentic message with one flipped byte in its values.
	tampered := []byte(recorded[0])
	tampered[len(tampered)-40] ^= 1
	pub(tampered)

	// The sentinel: once it arrives, everything injected before it was
	// read (one connection, one order).
	publish(t, honest, replica("r1", authentic+1))
	sentinel := s.next(t)
	require.Equal(t, "honest", sentinel.Publisher.Name)
	require.Equal(t, position.LSN(authentic+1), sentinel.Replica.Replayed)
	s.none(t)

	want := map[string]int64{
		"bad_signature":       50 + 10 + 1,
		"unsigned":            40,
		"unknown_key":         30,
		"replayed":            authentic,
		"malformed":           int64(malformed),
		"unsupported_version": 5,
		"bad_expiry":          0,
	}
	var total int64
	for r, n := range want {
		require.Equal(t, n, s.metrics.sum(t, "caughtup.feed.rejected", reason(r)), r)
		total += n
	}
	require.Equal(t, total, s.metrics.sum(t, "caughtup.feed.rejected"))
	require.Equal(t, int64(authentic+1), s.metrics.sum(t, "caughtup.feed.received"))

	logs := s.logs.String()
	for r := range want {
		if want[r] > 0 {
			require.Contains(t, logs, "reason="+r)
		}
	}
	require.Less(t, strings.Count(logs, "reason=bad_signature"), 50, "rejections are logged rate-limited")
}

// TestStoredForgeries: what an attacker writes into the stored values is
// judged like a live message, plus its expiry.
func TestStoredForgeries(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	name, k1 := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k1}}
	plain := client(t, nil)

	honest, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "honest", Keys: ring})
	obs := replica("r1", 100)
	publish(t, honest, obs)
	good := feed.ValueKeyForTest(name, "honest", &obs)
	authentic, err := plain.Get(ctx, good).Bytes()
	require.NoError(t, err)

	forger, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "forger", Keys: feed.Keyring{Keys: []feed.Key{key(t, "k1")}}})
	evil := replica("r2", 1<<62)
	publish(t, forger, evil) // stored under its own key, signed wrongly

	// The authentic bytes stored again without an expiry, and with a
	// longer one than signed: their age cannot be measured.
	for i, exp := range []time.Duration{0, time.Hour} {
		k := fmt.Sprintf("%s:copy%d", feed.ValueKeyForTest(name, "honest", &obs), i)
		require.NoError(t, plain.Set(ctx, k, authentic, exp).Err())
		require.NoError(t, plain.SAdd(ctx, feed.IndexKeyForTest(name), k).Err())
	}
	// A key outside the feed in the index is ignored.
	require.NoError(t, plain.SAdd(ctx, feed.IndexKeyForTest(name), "elsewhere").Err())

	s := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: ring})
	d := s.next(t)
	require.True(t, d.Stored)
	require.Equal(t, obs.Replica, d.Replica)
	s.waitState(t, feed.StateSubscribed)
	s.none(t)
	require.Equal(t, int64(1), s.metrics.sum(t, "caughtup.feed.rejected", reason("bad_signature")))
	require.Equal(t, int64(2), s.metrics.sum(t, "caughtup.feed.rejected", reason("bad_expiry")))
}

// TestKeyRotation: subscribers hold the old and the new key; publishers
// move from the old to the new one mid-stream. Every observation is
// delivered, and a subscriber that only knows the old key believes none
// signed with the new one.
func TestKeyRotation(t *testing.T) {
	t.Parallel()
	name := feedName(t)
	oldKey, newKey := key(t, "2025-05"), key(t, "2025-06")
	both := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: feed.Keyring{Keys: []feed.Key{oldKey, newKey}}})
	stale := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: feed.Keyring{Keys: []feed.Key{oldKey}}})
	both.waitState(t, feed.StateSubscribed)
	stale.waitState(t, feed.StateSubscribed)

	// Two redundant publishers; each is restarted with the new key as
	// Current, one after the other, while the other keeps publishing.
	ring := func(current string) feed.Keyring {
		return feed.Keyring{Keys: []feed.Key{oldKey, newKey}, Current: current}
	}
	a, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "a", Keys: ring("2025-05")})
	b, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "b", Keys: ring("2025-05")})
	lsn := position.LSN(0)
	step := func(ps ...*feed.Sender) {
		for _, p := range ps {
			lsn++
			publish(t, p, replica("r1", lsn))
		}
	}
	for range 10 {
		step(a, b)
	}
	require.NoError(t, a.Close())
	a, _ = startPublisher(t, feed.SenderConfig{Feed: name, Name: "a", Keys: ring("2025-06")})
	for range 10 {
		step(a, b)
	}
	require.NoError(t, b.Close())
	b, _ = startPublisher(t, feed.SenderConfig{Feed: name, Name: "b", Keys: ring("2025-06")})
	for range 10 {
		step(a, b)
	}

	got := both.until(t, func(d feed.Delivery) bool { return d.Replica.Replayed == lsn })
	require.Len(t, got, int(lsn), "no observation lost")
	for i, d := range got {
		require.Equal(t, position.LSN(i+1), d.Replica.Replayed)
	}
	require.Zero(t, both.metrics.sum(t, "caughtup.feed.rejected"))

	// Old-key messages: 20 from a and b before a's switch, then 10 from b;
	// new-key ones: 10 from a, then 20 from a and b.
	oldOnly := stale.until(t, func(d feed.Delivery) bool { return d.Replica.Replayed == 40 })
	var keyIDs []string
	for _, d := range oldOnly {
		keyIDs = append(keyIDs, d.KeyID)
	}
	require.Len(t, oldOnly, 30)
	require.Equal(t, []string{"2025-05"}, slices.Compact(keyIDs))
	// A sentinel signed with the old key: once the stale subscriber has
	// it, it has read everything before it.
	sentinel, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "sentinel", Keys: ring("2025-05")})
	publish(t, sentinel, replica("r1", lsn+1))
	require.Equal(t, "sentinel", stale.next(t).Publisher.Name)
	require.Equal(t, int64(30), stale.metrics.sum(t, "caughtup.feed.rejected", reason("unknown_key")))
	stale.none(t)
}

// TestRedisRestart: the subscriber reports the drop, retries while Redis
// is down, resubscribes when it is back, and the feed flows again.
func TestRedisRestart(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	r, err := pgtest.StartRedis(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, r.Close()) })
	opts := &redis.Options{Addr: r.Addr(), MaxRetries: -1, DialTimeout: time.Second}

	name, k := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k}}
	s := startSubscriber(t, feed.SubscriberConfig{Client: client(t, opts), Feed: name, Keys: ring,
		MinBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})
	s.waitState(t, feed.StateSubscribed)
	p, pm := startPublisher(t, feed.SenderConfig{Client: client(t, opts), Feed: name, Name: "a", Keys: ring})
	publish(t, p, replica("r1", 1))
	require.Equal(t, position.LSN(1), s.next(t).Replica.Replayed)

	require.NoError(t, r.Kill())
	require.Equal(t, []feed.State{feed.StateDropped}, s.waitState(t, feed.StateDropped))
	s.waitState(t, feed.StateUnreachable)
	require.NoError(t, p.Publish(replica("r1", 2)))
	require.Error(t, p.Flush(ctx), "Redis is down")

	require.NoError(t, r.Start(ctx))
	s.waitState(t, feed.StateSubscribed)
	publish(t, p, replica("r1", 3))
	d := s.next(t)
	require.Equal(t, position.LSN(3), d.Replica.Replayed)
	require.False(t, d.Stored)
	require.GreaterOrEqual(t, pm.sum(t, "caughtup.feed.publish.failures"), int64(1))
	require.Equal(t, int64(2), s.metrics.sum(t, "caughtup.feed.received"))
	require.GreaterOrEqual(t, s.metrics.sum(t, "caughtup.feed.health.transitions", attribute.String("caughtup.feed.state", "dropped")), int64(1))
}

// TestSilence: a feed with no authentic message past the bound is silent
// (forgeries do not count), and subscribed again at the next authentic one.
func TestSilence(t *testing.T) {
	t.Parallel()
	name, k := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k}}
	s := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: ring, SilenceBound: 200 * time.Millisecond})
	s.waitState(t, feed.StateSubscribed)

	// A flood of forgeries, faster than the subscriber's read timeout,
	// does not keep the silent feed looking alive.
	flooding, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		plain := client(t, nil)
		for {
			select {
			case <-flooding:
				return
			default:
			}
			_ = plain.Publish(context.Background(), feed.ChannelName(name), "\x01forged").Err()
		}
	}()
	s.waitState(t, feed.StateSilent)
	close(flooding)
	<-stopped
	require.Equal(t, feed.StateSilent, s.Health().State)
	require.Positive(t, s.metrics.sum(t, "caughtup.feed.rejected", reason("malformed")))

	forger, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "forger", Keys: feed.Keyring{Keys: []feed.Key{key(t, "k1")}}})
	publish(t, forger, replica("r1", 1))
	p, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "a", Keys: ring})
	publish(t, p, replica("r1", 2))
	require.Equal(t, []feed.State{feed.StateSubscribed}, s.waitState(t, feed.StateSubscribed), "the forgery changed nothing")
	require.Equal(t, position.LSN(2), s.next(t).Replica.Replayed)
}

func TestInsecure(t *testing.T) {
	t.Parallel()
	name, k := feedName(t), key(t, "k1")
	_, err := feed.NewSubscriber(feed.SubscriberConfig{Client: client(t, nil), Feed: name, OnObservation: func(feed.Delivery) {}})
	require.ErrorIs(t, err, feed.ErrInvalidConfig, "no key and no Insecure")
	_, err = feed.NewSender(feed.SenderConfig{Client: client(t, nil), Feed: name})
	require.ErrorIs(t, err, feed.ErrInvalidConfig, "no key and no Insecure")

	// Migration: subscribers take unsigned and signed messages, but still
	// reject a signature that does not verify.
	s := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: feed.Keyring{Keys: []feed.Key{k}}, Insecure: true})
	s.waitState(t, feed.StateSubscribed)
	require.Contains(t, s.logs.String(), "Insecure: true")
	unsigned, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "u", Insecure: true})
	signed, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "s", Keys: feed.Keyring{Keys: []feed.Key{k}}})
	forger, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "f", Keys: feed.Keyring{Keys: []feed.Key{key(t, "k1")}}})
	publish(t, unsigned, replica("r1", 1))
	require.Empty(t, s.next(t).KeyID)
	publish(t, forger, replica("r1", 2))
	publish(t, signed, replica("r1", 3))
	d := s.next(t)
	require.Equal(t, "k1", d.KeyID)
	require.Equal(t, position.LSN(3), d.Replica.Replayed)
	require.Equal(t, int64(1), s.metrics.sum(t, "caughtup.feed.rejected", reason("bad_signature")))
}

func TestPublisherBacklog(t *testing.T) {
	t.Parallel()
	// A Redis that never answers: the dial hangs (a closed port would
	// refuse at once; this one is a listening socket nobody accepts on).
	p, m := startPublisher(t, feed.SenderConfig{Client: client(t, &redis.Options{Addr: blackhole(t), DialTimeout: 200 * time.Millisecond, MaxRetries: -1}),
		Feed: feedName(t), Name: "a", Insecure: true, MaxPending: 2, Timeout: 200 * time.Millisecond})
	require.NoError(t, p.Publish(replica("r1", 1)))
	require.NoError(t, p.Publish(replica("r1", 2))) // replaces, or follows, the first
	require.NoError(t, p.Publish(replica("r2", 1)))
	err := p.Publish(replica("r3", 1))
	if err != nil {
		require.ErrorIs(t, err, feed.ErrBacklog)
	}
	require.Error(t, p.Flush(testContext(t)))
	require.NoError(t, p.Close())
	require.ErrorIs(t, p.Publish(replica("r1", 3)), feed.ErrClosed)
	require.GreaterOrEqual(t, m.sum(t, "caughtup.feed.publish.failures"), int64(1))
}

// TestResubscriptionOverlap: live messages published while a subscriber
// read the stored values, older than the value it read, are the overlap
// of the subscription (duplicates), not replays; once a live message of
// the stream has arrived, an older one is a replay.
func TestResubscriptionOverlap(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	name, k1 := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k1}}
	spy := client(t, nil).Subscribe(ctx, feed.ChannelName(name))
	defer spy.Close()
	_, err := spy.Receive(ctx)
	require.NoError(t, err)
	honest, _ := startPublisher(t, feed.SenderConfig{Feed: name, Name: "honest", Keys: ring})
	var recorded []string
	for i := 1; i <= 2; i++ {
		publish(t, honest, replica("r1", position.LSN(i)))
		msg, err := spy.ReceiveMessage(ctx)
		require.NoError(t, err)
		recorded = append(recorded, msg.Payload)
	}

	// The subscriber starts from the stored value (sequence 2); sequence
	// 1, and 2 itself, then arrive live as they would had they been
	// published while it read the store.
	s := startSubscriber(t, feed.SubscriberConfig{Feed: name, Keys: ring})
	d := s.next(t)
	require.True(t, d.Stored)
	require.Equal(t, position.LSN(2), d.Replica.Replayed)
	s.waitState(t, feed.StateSubscribed)
	plain := client(t, nil)
	for _, m := range []string{recorded[0], recorded[1], recorded[0]} {
		require.NoError(t, plain.Publish(ctx, feed.ChannelName(name), m).Err())
	}
	publish(t, honest, replica("r1", 3)) // the sentinel
	require.Equal(t, position.LSN(3), s.next(t).Replica.Replayed)
	s.none(t)
	require.Equal(t, int64(2), s.metrics.sum(t, "caughtup.feed.duplicates"), "sequence 1, then 2, live after the stored 2")
	require.Equal(t, int64(1), s.metrics.sum(t, "caughtup.feed.rejected", reason("replayed")), "sequence 1 again, after 2 arrived live")
}

// TestPublishWhileSending: pollers publish at about the pace the
// sending goroutine sends, so that it often wakes to find nothing pending
// (a wake-up for an observation it has already sent) while the next
// Publish writes; under -race, any access to the pending observations
// outside the lock shows here. Every observation is published.
func TestPublishWhileSending(t *testing.T) {
	t.Parallel()
	p, m := startPublisher(t, feed.SenderConfig{Feed: feedName(t), Name: "a", Insecure: true})
	const pollers, polls = 3, 200
	var wg sync.WaitGroup
	for w := range pollers {
		wg.Go(func() {
			for i := range polls {
				if !assert.NoError(t, p.Publish(replica(fmt.Sprintf("r%d", w), position.LSN(i+1)))) {
					return
				}
				// The pollers' schedule, not a wait for a condition.
				time.Sleep(time.Duration(rand.IntN(300)) * time.Microsecond)
			}
		})
	}
	wg.Wait()
	require.NoError(t, p.Flush(testContext(t)))
	require.Equal(t, int64(pollers*polls), m.sum(t, "caughtup.feed.published")+m.sum(t, "caughtup.feed.publish.dropped"))
}
