// Package feed carries replica and primary observations from a few
// publisher processes to every router of a fleet through Redis, and keeps
// a fleet-wide budget of primary fallback reads there. It is the Redis
// implementation of replay's feed: a Sender is a replay.FeedSender
// (replay.PublisherConfig.Feed), a Subscriber a replay.FeedSource
// (replay.FeedConfig.Source), and a Budget a consume.FleetBudget; the
// values it carries are replay's (Observation is replay.FeedObservation),
// its keys package sign's (Key is sign.Key).
//
// A few redundant publishers (no leader) poll every node and Publish one
// Observation per poll. Each is signed, stored as that publisher's latest
// value for the node (SET with an expiry) and published on the feed's
// channel. Routers run a Subscriber: on every (re)subscription it reads
// the stored values, then streams the live messages, and hands each
// authentic, unsuperseded observation to a callback with the time it was
// received on the router's own clock. Its health (subscribed, silent,
// unreachable, dropped) goes to another callback, so that the router can
// poll by itself while the feed is not usable, and come back.
//
//	// rdb is the Redis the fleet shares, e.g.
//	// redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"redis:6379"}}).
//	func keyring() (feed.Keyring, error) {
//		keys, err := feed.ParseKeys(os.Getenv("CAUGHTUP_FEED_KEYS")) // "id:base64secret,…"
//		return feed.Keyring{Keys: keys}, err
//	}
//
//	// A publisher: polls the nodes and publishes what it reads.
//	func publisher(ctx context.Context, dbs map[string]replay.Database, rdb redis.UniversalClient, keys feed.Keyring) (*replay.Publisher, error) {
//		snd, err := feed.NewSender(feed.SenderConfig{Client: rdb, Name: "feed-a", Keys: keys})
//		if err != nil {
//			return nil, err
//		}
//		return replay.NewPublisher(ctx, dbs, replay.PublisherConfig{Feed: snd}) // its Close closes snd
//	}
//
//	// A router's tracker: takes the nodes' positions from the feed.
//	func tracker(ctx context.Context, dbs map[string]replay.Database, rdb redis.UniversalClient, keys feed.Keyring) (*replay.Tracker, error) {
//		src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: rdb, Keys: keys})
//		if err != nil {
//			return nil, err
//		}
//		return replay.NewTracker(ctx, dbs, replay.TrackerConfig{Feed: &replay.FeedConfig{Source: src}})
//	}
//
// A program of its own can also run a subscription with callbacks of its
// own (Run; OnObservation receives every Delivery, OnHealth every Health),
// and publish with Sender.Publish.
//
//	func newBudget(rdb redis.UniversalClient) (*feed.Budget, error) { // once per process
//		return feed.NewBudget(feed.BudgetConfig{Client: rdb, Rate: 50, Burst: 50})
//	}
//
//	func mayReadPrimary(ctx context.Context, budget *feed.Budget) (bool, error) {
//		return budget.Allow(ctx, "main") // an error: Redis unavailable; the per-process cap decides
//	}
//
// The package moves observations; it does not interpret them. Which
// observations a router believes, and for how long, is its merge's job
// (see docs/feed.md, "What the subscriber guarantees").
//
// The wire format (one signed message per observation, version 1), the
// authentication and replay rules, the Redis keys, Cluster, Sentinel, ACLs
// and TLS are in docs/feed.md. In short: every message carries an
// HMAC-SHA256 under a key of the Keyring (Insecure must be asked for to
// accept unsigned ones), a publisher instance and a sequence, so that
// forged, unsigned, unknown-key, malformed, replayed and impossible
// messages are rejected and counted, never delivered; the feed's keys and
// channel share one hash slot, so Cluster and Sentinel clients work as
// they are (on a *redis.ClusterClient the feed uses sharded pub/sub,
// SPUBLISH and SSUBSCRIBE, so that a message reaches only its slot's
// shard rather than every node; see cluster.go);
// PublisherACL, SubscriberACL and BudgetACL give the least rights each
// role needs.
//
// # Fleet budget
//
// Budget is one GCRA rate limit per key (per primary), shared by every
// process on the same Redis: at most Rate×t/Period + Burst events pass in
// any span t, whatever the number of processes. Allow answers within
// Timeout; when Redis cannot answer it returns an error wrapping
// ErrBudgetUnavailable and stays silent for Cooldown, and the caller's
// per-process cap alone bounds its reads (it logs and counts that).
// go-redis bounds a new connection's handshake by the client's
// ReadTimeout rather than the context; Allow does not wait for it, but
// give the budget's client short DialTimeout and ReadTimeout (e.g.
// 100ms) so that abandoned calls do not linger.
//
// # Metrics
//
// Synchronous counters, whose totals survive Close and Run returning:
// caughtup.feed.published, caughtup.feed.publish.failures (error.type),
// caughtup.feed.publish.dropped (caughtup.reason superseded or backlog),
// caughtup.feed.received (caughtup.feed.source live or stored),
// caughtup.feed.rejected (caughtup.reason malformed, unsupported_version,
// unsigned, unknown_key, bad_signature, replayed, bad_expiry),
// caughtup.feed.duplicates,
// caughtup.feed.health.transitions (caughtup.feed.state). Gauges, while
// their owner runs: caughtup.feed.publish.pending and
// caughtup.feed.health.state. All carry db.system.name=redis and
// messaging.destination.name=the channel.
package feed
