// Package feed carries replica and primary observations from a few
// publisher processes to every router of a fleet through Redis, and keeps
// a fleet-wide budget of primary fallback reads there.
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
//	keys, _ := feed.ParseKeys(os.Getenv("CAUGHTUP_FEED_KEYS")) // "id:base64secret,…"
//	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"redis:6379"}})
//
//	pub, _ := feed.NewSender(feed.SenderConfig{Client: rdb, Name: "feed-a", Keys: feed.Keyring{Keys: keys}})
//	defer pub.Close()
//	_ = pub.Publish(feed.Observation{Database: "main", Node: "replica-1", Role: feed.RoleReplica,
//		PolledAt: start, Replica: feed.ReplicaStatus{InRecovery: true, Replayed: lsn, Epoch: epoch}})
//
//	sub, _ := feed.NewSubscriber(feed.SubscriberConfig{Client: rdb, Keys: feed.Keyring{Keys: keys},
//		OnObservation: func(d feed.Delivery) { merge(d) },   // the router's merge
//		OnHealth:      func(h feed.Health) { useFeed(h.State == feed.StateSubscribed) }})
//	go sub.Run(ctx)
//
//	budget, _ := feed.NewBudget(feed.BudgetConfig{Client: rdb, Rate: 50, Burst: 50})
//	ok, err := budget.Allow(ctx, "main") // err: Redis unavailable; the per-process cap decides
//
// The package moves observations; it does not interpret them. Which
// observations a router believes, and for how long, is its merge's job
// (see "What the subscriber guarantees, and what it leaves to the merge").
//
// # Wire format (version 1)
//
// One message is one observation of one node. Integers are unsigned
// LEB128 varints (uvarint) unless marked; "zigzag" is a signed varint as
// encoding/binary writes it; str8 is a one-byte length and that many
// bytes. Times are microseconds since the Unix epoch. Every varint must be
// minimal, every length within its limit, flags must have no unknown bits
// and no byte may follow the end, so that an accepted message has exactly
// one encoding; parsing never panics (FuzzParseMessage) and stops at
// MaxMessageSize (16 KiB).
//
//	version      1 byte   1; any other value: RejectUnsupportedVersion
//	key ID       str8     0–64 of [A-Za-z0-9._-]; empty: unsigned
//	publisher    str8     1–128, the stable name (SenderConfig.Name)
//	instance     8 bytes  big-endian, random per Sender
//	sequence     uvarint  ≥ 1, +1 per message of this instance
//	sent at      zigzag   µs; the publisher's clock, informational only
//	TTL          uvarint  ms the value was stored with (SET … PX/EX)
//	held         uvarint  µs from the poll's start to encoding, on the
//	                      publisher's monotonic clock
//	database     str8     1–128 bytes
//	node         str8     0–128 bytes (1–128 for a replica)
//	role         1 byte   1 primary, 2 replica
//	error        uvarint length (≤ 512) + UTF-8; non-empty: the poll
//	                      failed and no values follow
//	primary values:
//	  flags      1 byte   bit 0: history known
//	  system id  8 bytes  big-endian
//	  timeline   uvarint  (≤ 2³²−1)
//	  insert LSN uvarint
//	  max align, WAL block size, WAL segment size: 3 uvarints
//	  history    uvarint count (≤ 512; 0 unless known), then per entry
//	             timeline uvarint, switchpoint uvarint
//	replica values:
//	  flags      1 byte   bit 0 in recovery, bit 1 replay timestamp
//	                      present, bit 2 incarnation present, bit 3
//	                      recovery start present (only with bit 2)
//	  replay LSN uvarint  0: NULL
//	  system id  8 bytes  0: unknown
//	  timeline   uvarint  received_tli; 0: unknown
//	  replay timestamp    zigzag µs, when flagged
//	  time lag   uvarint  µs, computed on the server
//	  incarnation         zigzag µs (pg_postmaster_start_time), when flagged
//	  recovery start      zigzag µs (the startup process's start), when
//	                      flagged
//	signature    32 bytes HMAC-SHA256, present iff the key ID is not empty
//
// A primary observation is about 50 bytes plus names, a replica's about
// 60; with the envelope and signature a message is typically 100–150
// bytes.
//
// # Authentication
//
// The signature is HMAC-SHA256 under the key the key ID names, over
// "caughtup/feed/v1", a zero byte, the feed name, a zero byte, and every
// byte of the message before the signature: the envelope and the values,
// exactly as sent. The feed name is signed but not sent, so a message of
// one feed never verifies on another feed that shares the key. Signatures
// are compared in constant time (hmac.Equal).
//
// Publishers sign with one key (Keyring.Current); subscribers accept any
// key of their Keyring. Rotating a key takes no downtime: add the new key
// to every subscriber and publisher, switch the publishers' Current to it
// (a rolling restart: a Sender signs with the Current it was made
// with, and its redundant peers keep the feed going meanwhile), and
// remove the old key once no publisher uses it. A subscriber restarted
// with a new Keyring starts a new replay memory; see Replays.
//
// A subscriber rejects, never delivers, counts (caughtup.feed.rejected,
// by reason) and logs (the first three, then one per 10s, per reason)
// every message that is malformed, of an unsupported version, unsigned,
// signed with an unknown key, wrongly signed, replayed, or stored with an
// expiry no publisher sets. Rejected messages do not count as signs of
// life: a flood of forgeries cannot keep a silent feed looking alive.
//
// Running without a key is a choice made in the config (Insecure: true)
// and logged as a warning when the publisher or subscriber is made; an
// empty keyring without it is a configuration error.
//
// # Replays
//
// Each publisher instance numbers its messages 1, 2, 3, … A subscriber
// remembers, per publisher instance and node, the highest number it has
// delivered, and rejects (RejectReplayed) any message of that instance
// and node at or below it. A message read from the stored values and
// then received live (or stored again, on the next resubscription) is
// the expected overlap, not a replay, and so is a live message that was
// published while the subscriber read the store (older than the value it
// read, arriving before anything newer of its stream): they are dropped
// without a rejection and counted as caughtup.feed.duplicates. The memory holds MaxStreams
// entries; beyond that the least recently heard are forgotten.
//
// # What the subscriber guarantees, and what it leaves to the merge
//
// Every delivered observation was signed by a holder of a configured key
// for this feed, has not been delivered before, and is newer than every
// earlier delivery from the same publisher instance about the same node.
// Its ReceivedAt is the subscriber's clock, and its Age (publisher's hold
// plus time stored in Redis, each measured on one clock) only ever makes
// it look older. Age = Held for live messages: their transit is not
// measured.
//
// Not guaranteed, and the consumer's merge must handle:
//
//   - Freshness. A message can be delayed (a publisher paused between
//     encoding and sending, a slow network), and a subscriber that never
//     heard of a publisher instance accepts that instance's old messages
//     once. Judge staleness by ReceivedAt − Age on the router's own
//     clock, never by SentAt, and treat an observation older than the
//     staleness bound as unknown.
//   - Order across publishers. Several publishers report the same node;
//     nothing orders their messages. Merge replay and insert positions
//     by maximum within one epoch and one incarnation (positions only
//     grow there), and take an epoch or timeline change, a restart
//     (incarnation) or a node leaving recovery from what can only move
//     forward (a later timeline, a later incarnation), never from
//     arrival order alone.
//   - Truth. An authentic observation can still be impossible next to
//     others, e.g. a replica replaying past the primary's insert position
//     of the same epoch (a compromised publisher, or a bug): treat such a
//     node as unknown, and unknown as infinitely behind.
//
// These are the router's rules, in package consume.
//
// # Redis: keys, Cluster, Sentinel
//
// A feed named F uses the channel "{caughtup.feed.F}:obs", one key per
// publisher and node "{caughtup.feed.F}:latest:…" and an index set
// "{caughtup.feed.F}:index". The shared hash tag puts them all in one
// Cluster slot, so reading values with their expiries in one MULTI works
// there, and one ACL pattern covers them. Each publisher pipeline is, per
// observation, SET key value PX TTL and PUBLISH channel value, then SADD
// index keys… and PEXPIRE index TTL.
//
// Both sides take a redis.UniversalClient, so the deployment is go-redis's
// choice, not this package's:
//
//	// one server, or a managed endpoint
//	redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"redis:6379"}})
//	// Sentinel: the master set's name selects a failover client
//	redis.NewUniversalClient(&redis.UniversalOptions{MasterName: "mymaster",
//		Addrs: []string{"sentinel-1:26379", "sentinel-2:26379"}, SentinelPassword: …})
//	// Cluster: several seed addresses (or NewClusterClient)
//	redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"node-1:6379", "node-2:6379"}})
//
// In a Cluster, PUBLISH reaches subscribers on every node (classic, not
// sharded, pub/sub). After a Sentinel failover the subscription breaks;
// the subscriber reports StateDropped and resubscribes to the new master.
// The values are not persisted by the feed: after a Redis restart they
// come back with the publishers' next polls.
//
// # Redis access control
//
// Give publishers and routers their own Redis users (Redis 6+ ACL; the
// read-only key pattern %R~ needs Redis 7). PublisherACL, SubscriberACL
// and BudgetACL return the rules; for the default feed:
//
//	ACL SETUSER caughtup-feed-pub on >PUBSECRET resetkeys resetchannels -@all ~{caughtup.feed.default}:* &{caughtup.feed.default}:obs +set +sadd +pexpire +publish +ping
//	ACL SETUSER caughtup-router on >SUBSECRET resetkeys resetchannels -@all %R~{caughtup.feed.default}:* &{caughtup.feed.default}:obs +get +pttl +smembers +multi +exec +subscribe +unsubscribe +ping ~rate:caughtup.budget.* +evalsha +eval +get +set +time
//
// go-redis sends CLIENT SETINFO on connecting and ignores a refusal; on
// Redis 7.2 and later add +client|setinfo to both users, or set
// DisableIdentity in the client options, to keep refusals out of ACL LOG.
//
// Publishers write only the feed's keys and publish only on its channel;
// routers read the feed's keys and subscribe, and write only the budget's
// keys (through the GCRA script). The HMAC keeps a Redis user that can
// write the feed from moving routers; the ACL keeps everyone else from
// even trying, and keeps a router from posing as a publisher. Set the user
// with redis.UniversalOptions{Username, Password}.
//
// # TLS
//
// TLS is go-redis's: set UniversalOptions.TLSConfig (a *tls.Config with
// the CA that signed the server's certificate in RootCAs, ServerName when
// connecting by IP or through Sentinel, and Certificates for client
// certificates when the server sets tls-auth-clients). Redis serves TLS
// on tls-port with tls-cert-file, tls-key-file and tls-ca-cert-file.
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
// caughtup.feed.rejected (caughtup.reason), caughtup.feed.duplicates,
// caughtup.feed.health.transitions (caughtup.feed.state). Gauges, while
// their owner runs: caughtup.feed.publish.pending and
// caughtup.feed.health.state. All carry db.system.name=redis and
// messaging.destination.name=the channel.
package feed
