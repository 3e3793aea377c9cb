// Package replay knows what each replica of a database has replayed: the
// Tracker that watches the nodes (polling each one, or taking their
// observations from a position feed that a few Publishers fill), the
// immutable Snapshot it publishes, and the rules by which observations
// merge into it. consume.Router decides on its snapshots; the caughtup
// watch command prints them.
//
//	func watch(ctx context.Context, primary, r1, r2 *pgxpool.Pool) error {
//		dbs := map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(r1, r2)}}
//		tr, err := replay.NewTracker(ctx, dbs, replay.TrackerConfig{})
//		if err != nil {
//			return err
//		}
//		defer tr.Close()
//		s := tr.Snapshot()
//		for _, r := range s.Database("main").Replicas {
//			fmt.Println(r.Name, r.Replayed, r.Usable(time.Now().Add(-tr.Config().StalenessBound)))
//		}
//		<-s.Changed() // closed when a newer snapshot replaces s
//		return nil
//	}
//
// The tracker polls each node with a one-connection pool of its own, made
// from the node pool's config, once per TrackerConfig.PollInterval, and
// every WaitPollInterval while someone waits on a replica (Watch). Each
// poll yields a ReplicaObservation or PrimaryObservation; merging one is a
// pure step whose rules (monotone facts by maximum within a server's run,
// a new run replaces the state, transient conditions from the newest,
// impossible values unknown) never make a replica look further than it
// is: what can go wrong is availability, never freshness. Unknown is
// infinitely behind, in one predicate: ReplicaState.Usable.
//
// # Fleets: the position feed
//
// With many worker processes, run a few Publishers (NewPublisher, or the
// caughtup feed command) and give every tracker a TrackerConfig.Feed: the
// publishers poll each node and send signed observations to a FeedSender,
// and trackers merge what their FeedSource delivers as they merge their
// own polls, believing only authentic messages about nodes and server runs
// they have identified themselves, on their own clock, never past the
// primary's known position. A tracker on the feed connects to a replica
// only once it is asked about one (its first Snapshot or Watch: a job is
// being routed), to identify it; until then, and while that query cannot
// reach the replica, the replica is unknown, and the query is retried
// with a jittered backoff (FeedConfig.RetryMax), never on the polling
// schedule. A node the feed does not cover, or a feed that is silent,
// unreachable or dropped, is polled locally until the feed covers it
// again; a node it cannot reach then is retried with the same backoff,
// and the feed's observations of it still count. This package knows no transport: package feed
// implements both interfaces on Redis.
//
//	// In two or three processes: poll the nodes, publish to Redis.
//	func publish(ctx context.Context, dbs map[string]replay.Database, rdb redis.UniversalClient, keys feed.Keyring) (*replay.Publisher, error) {
//		snd, err := feed.NewSender(feed.SenderConfig{Client: rdb, Name: "worker-7", Keys: keys})
//		if err != nil {
//			return nil, err
//		}
//		return replay.NewPublisher(ctx, dbs, replay.PublisherConfig{Feed: snd}) // its Close closes snd
//	}
//
//	// In every router's process: take the nodes' positions from Redis.
//	func track(ctx context.Context, dbs map[string]replay.Database, rdb redis.UniversalClient, keys feed.Keyring) (*replay.Tracker, error) {
//		src, err := feed.NewSubscriber(feed.SubscriberConfig{Client: rdb, Keys: keys})
//		if err != nil {
//			return nil, err
//		}
//		return replay.NewTracker(ctx, dbs, replay.TrackerConfig{Feed: &replay.FeedConfig{Source: src}})
//	}
//
// The rules, and why no merge of feed messages reads stale, are in
// docs/design.md; costs and sizing in docs/fleet.md.
//
// # Roles
//
// The tracker's role needs pg_read_all_stats (pg_stat_wal_receiver hides a
// standby's timeline otherwise, and the startup process that tells a
// crash restart apart) and EXECUTE on pg_read_file(text) for the timeline
// history after a failover, and CONNECT on the database (PUBLIC has it
// unless revoked). A privilege it lacks makes the node unknown with a
// *GrantError (ErrMissingGrant) that names the GRANT to run, logged once;
// a CONNECT refused when the connection opens, before any query, is one.
// See docs/roles.md.
//
// # Metrics
//
// Under ScopeName (names kept from when this was part of consume):
// caughtup.consume.tracker.queries, .tracker.staleness,
// caughtup.consume.replica.lag, .replica.lag.time, .replica.restarts,
// .replica.restart.hold, .replica.diverged,
// caughtup.consume.tracker.observations.rejected (caughtup.reason
// impossible or superseded), and on a feed caughtup.consume.feed.switches
// (caughtup.feed.direction to_feed or to_local, caughtup.feed.state),
// .feed.active, .feed.nodes.local, caughtup.consume.feed.observations.rejected
// (caughtup.reason delayed, unknown_node, unconfirmed, mismatch,
// no_incarnation, superseded, unverified) and
// caughtup.consume.publisher.unchanged.
package replay
