// Package consume is the consumer side of caughtup: it decides, for each
// job, which pool the handler reads each database from, so that the job
// sees at least what its producer wrote.
//
// One Router per process watches every replica in the background (the
// tracker: one query per node per Config.PollInterval, whatever the job
// rate) and routes jobs against an immutable snapshot of what it saw.
// Decide is the routing rule as a pure function of the policy, the job's
// token, the snapshot and the clock; Route wraps it with the I/O: it waits
// for a replica to catch up (waking on the tracker's observations, which
// come every Config.WaitPollInterval while anyone waits), applies the
// fallback cap and records metrics and logs.
//
//	router, err := consume.NewRouter(ctx, consume.Config{
//		Databases: map[string]consume.Database{
//			"main": {Primary: primary, Replicas: consume.Replicas(replica1, replica2)},
//		},
//	})
//	if err != nil { ... }
//	defer router.Close()
//
//	// In the queue adapter, per job (the adapters in caughtup/asynq and
//	// caughtup/kafka do this for you):
//	tok, decodeErr := position.DecodeHeaders(values...)
//	if decodeErr != nil {
//		ctx = consume.WithSource(ctx, "asynq email:send") // names the producer in warnings
//	}
//	ctx, d, err := router.RouteDecoded(ctx, tok, decodeErr, consume.PolicyDefault)
//	var de *consume.DeferError
//	if errors.As(err, &de) { ... run the job again after de.Delay ... }
//
//	// In the handler, the pool chosen for this job:
//	rows, err := consume.DB(ctx, "main").Query(ctx, "SELECT ...")
//	// or, to fail the job rather than panic on a misconfiguration:
//	pool, err := consume.Pool(ctx, "main")
//	// or database/sql over the same pool (GORM, sqlx, sqlc, ent, bun):
//	sqlDB, err := consume.SQLDB(ctx, "main")
//
// Route takes the header text as carried, RouteToken a decoded token (CDC
// events carry their position), RouteDecoded a token with its decode
// error, and RouteVerified a token whose position is necessary but not
// sufficient (a Debezium event's source.lsn is its change, below its
// commit): a Verifier must confirm on the replica chosen that it shows
// the job's writes, and a replica it finds behind counts as behind, so
// the job waits, defers or reads the primary in the same place, under the
// same budget, cap and metrics. A Tally routes like its Router but adds
// the counts in bulk when flushed, for adapters whose message rate makes a
// counter Add per job costly (the Kafka consumer flushes at every commit). The handler's context also carries the decision (DecisionFrom)
// and, for the jobs the handler enqueues, the job's token raised to what
// the chosen replicas had replayed (enqueue.TokenFrom).
//
// Unknown is infinitely behind: a replica whose position is NULL, whose
// query failed, whose last observation is older than
// Config.StalenessBound, whose epoch is unknown or that has left recovery
// is never chosen. When no replica can serve a job it reads the primary,
// unless the policy lets it wait or be deferred, or the fallback cap
// (Config.PrimaryRate) refuses the promotion; it is never served stale.
//
// Deferral is bounded by the token's age, from the producer's capture
// time, so it needs no attempt counter. A capture time more than
// Config.ClockSkewTolerance ahead of the consumer's clock makes the age
// unknown: such a job is not deferred but reads the primary after its
// wait, and the skew is counted and logged.
//
// Waiting polls: PostgreSQL 19's WAIT FOR LSN is not used yet (these
// servers are 15). While any job waits on a replica, the tracker polls it
// every Config.WaitPollInterval (5ms), shared by every job waiting on it:
// polls of one replica are never closer than that, however many jobs wait
// and however often new ones arrive, so waiting costs a replica at most
// 200 queries/s per process.
//
// A deferred job need not wait out its delay: CaughtUp (pure) and
// Router.CaughtUp say whether a replica has replayed a token, by Decide's
// rule; Router.WaitCaughtUp waits for it on the tracker's snapshots,
// watching the replicas as a waiting job does (Router.Watch). The asynq
// adapter wakes deferred tasks this way, the kafka adapter retry-topic
// messages. FirstCaughtUp finds, in recorded snapshots, when the tracker
// first saw a token caught up, to measure how long deferred work took to
// run after that.
//
// A standby left on an older timeline after a failover, past the point
// where the primary's history left it, is diverged: it holds rows the
// primary never had and never reaches the primary's timeline, so no job
// reads it or waits on it (ReasonDivergedStandby). A replica that
// restarted may show less than it had replayed; the tracker sees the
// restart (Incarnation) and counts the replica as behind every token until
// it passes its old position, and a ReplicaGuard installed on the
// replica's pool closes the remaining window for jobs routed before the
// restart was seen.
//
// Metrics are OpenTelemetry instruments under ScopeName: synchronous
// counters and a histogram whose sums outlive Close, and gauges of
// replica lag and tracker staleness that end with the Router.
//
// Tokens carry end positions, so "caught up" is replay ≥ token within one
// epoch, or across a failover only up to the switchpoint. Positions that
// the new history does not contain (a write lost in an asynchronous
// failover or crash) cannot be detected by any token: handlers must
// tolerate a row that is not found.
//
// # How observations merge
//
// Each poll of a node yields a PrimaryObservation or ReplicaObservation
// (what the query returned, or its error) with ObservedAt set from the
// local clock when the query was sent, or, for a position feed, when its
// message was received. One step merges it into the snapshot: a node's
// state is a fold of its observations, in whatever order they arrive. The
// tracker's own polls arrive in order; a feed may deliver one node's
// observations from several publishers out of order. The merge is a pure
// function of (state, observation) and follows these rules.
//
//  1. Monotone facts merge by maximum, so that order does not matter.
//     Within one incarnation of a replica: its position, ordered by
//     timeline then LSN, and its leaving recovery (once out, it stays out).
//     For the primary, within one system: its position, ordered by
//     timeline then insert LSN, and a timeline's history (a timeline's
//     history file never changes).
//  2. A change of incarnation (a restart) or of system is taken from the
//     newest observation and never undone: an observation of a newer
//     incarnation replaces the replica's state, position included, since
//     a restarted standby may show less than it had replayed; nothing of an
//     older incarnation (or, for the primary, of an older timeline) is
//     merged after it, whenever it arrives. A primary of another system
//     replaces the state only if it is the newest by ObservedAt.
//  3. Transient conditions come from the newest observation by
//     ObservedAt and are never undone by an older one: a failed query,
//     an unknown timeline (no WAL receiver), the replay timestamp and time
//     lag. ObservedAt, which staleness is judged by, is that of the newest
//     successful observation.
//  4. Impossible observations count as unknown. A replica position ahead
//     of the primary's insert position in the same epoch, where the
//     primary's was read after the replica's (its ObservedAt is no earlier
//     than the replica observation's ReadBy), cannot be true (replay never
//     passes what was inserted): the observation is not merged and the
//     replica's Err becomes ErrImpossibleObservation. A primary
//     observation that shows a replica's merged position to be impossible
//     drops that position too, so that it can never come back through the
//     maximum.
//  5. Derived values (byte lag, health, divergence, the restart hold and
//     HighestReplayed) are recomputed from the merged state and the
//     primary after every merge.
//
// Why these rules never produce a stale read. A replica's replay only
// grows within an incarnation, and a position read at ObservedAt was
// reached at or after that moment; so the maximum of the positions seen in
// one incarnation is a lower bound of what the replica holds from then
// on, whoever saw them and in whatever order they arrive (rule 1). A
// restart is the one event that lowers what a replica shows; it always
// comes with a newer incarnation, which replaces the state rather than
// being merged with it, and after which positions from before the restart
// are never used again (rule 2); the replica is then held behind until it
// passes what it had (RestartFloor). (A crash restart in which the
// postmaster survives is told by the startup process's start time, which
// the tracker's role sees with pg_read_all_stats, as it does the WAL
// receiver's timeline.) A late or lost observation only
// leaves the state older: staleness is judged by the local clock at which
// observations were made or received, and a replica whose newest
// observation is older than Config.StalenessBound is unknown, which is
// infinitely behind. An error, an unknown timeline or an impossible value
// make the replica unknown, never caught up (rules 3 and 4). What can go
// wrong is availability, never freshness: a wrong "unknown" sends jobs to
// wait, defer or read the primary.
//
// # Fleet scale: the position feed and the fleet budget
//
// Each Router polling by itself costs every replica one query per
// PollInterval per process (and up to one per WaitPollInterval while jobs
// wait), and each process's fallback cap adds to the primary's load. With
// many worker processes, run a few Publishers instead (NewPublisher
// embedded in any process, or the `caughtup feed` command; two for
// redundancy, no leader) and give every Router a Config.Feed: the
// publishers poll each node every DefaultFeedInterval (10ms) and publish
// its observation to Redis (package feed: signed, stored as the latest
// value, and sent on a channel) whenever it changed, and at least every
// DefaultFeedHeartbeat (100ms), so an idle node costs each router ten
// messages a second per publisher rather than a hundred; routers
// subscribe and merge what arrives exactly as they merge their own
// polls. Replica load then depends on the
// number of publishers, not of routers, and waiting jobs wake on feed
// messages: waiting makes no router poll.
//
//	pub, err := consume.NewPublisher(ctx, consume.PublisherConfig{
//		Databases: dbs, // the same names as the routers'
//		Feed:      feed.SenderConfig{Client: rdb, Name: "worker-7", Keys: keys},
//	})
//	router, err := consume.NewRouter(ctx, consume.Config{
//		Databases:   dbs,
//		Feed:        &consume.FeedConfig{Client: rdb, Keys: keys},
//		FleetBudget: budget, // feed.NewBudget(feed.BudgetConfig{Client: rdb, Rate: 200})
//	})
//
// What a Router on the feed believes, and why no merge of feed messages
// reads stale:
//
//   - Only authentic messages (package feed: an HMAC under one of
//     FeedConfig.Keys; unsigned ones only with FeedConfig.Insecure, which
//     is logged). Others are rejected and counted (caughtup.feed.rejected)
//     and change nothing.
//   - Freshness on the router's clock. An observation's ObservedAt is the
//     router's receipt time less the age the feed measured (the
//     publisher's hold on its monotonic clock, plus time stored in Redis on
//     Redis's clock); a publisher's wall clock never makes anything look
//     fresher. It is used only to refuse a message received more than
//     FeedConfig.MaxDelay after it was sent (a replayed or long-delayed
//     message), so that an old message cannot pass for a new one for
//     longer than that. Staleness is then judged as for local polls.
//   - Only nodes the router knows. At start the Router polls every node
//     itself and subscribes once those polls are in: it knows each
//     replica's current run (Incarnation) and the system. A feed
//     observation of a node its own polls have not identified yet, of
//     another system, or without a run, is not merged. One of an older run
//     than the router's own poll saw (a message from before a restart,
//     late or replayed, whoever sends it) is superseded: rule 2 keeps
//     anything of an earlier run from being merged. One of a newer run
//     makes the replica unknown at once (a restart may have lowered it)
//     and makes the router poll it: if its own poll shows that run, the
//     restart is merged as any restart (held below its old position); if
//     not, the publishers mean another server by that name, and their
//     observations of that run are ignored. Name mismatches are therefore
//     never fresh: publishers and routers must name databases and replicas
//     alike (Database, Replica.Name), and a name that differs costs
//     queries (the router polls that node itself), not freshness.
//   - Never more than the primary is known to hold. A replica position of
//     the primary's epoch past the primary's known insert position (or any
//     position while the primary is unknown) is held back until a primary
//     observation arrives: one that shows it possible merges it; one made
//     after it was received that shows it impossible makes the replica
//     unknown (rule 4); one that does neither within StalenessBound drops
//     it. Publishers poll the primary right after the replicas in each
//     round, so a true position waits about one round trip. A replica
//     observation without this check could be a publisher's bug or a
//     compromised key holder's lie, believed for a round.
//   - Within a run positions only grow, so the maximum of authentic,
//     possible positions of the router's own known run is a lower bound of
//     what the replica holds, whichever publisher sent them and in
//     whatever order they arrive (rule 1). A late or replayed message of
//     that run carries a position the replica had already passed; the only
//     event that lowers a replica, a restart, comes with a newer run that
//     the publishers still running report within a round (and which the
//     router confirms), and MaxDelay bounds how long an old message can
//     pose as new. A ReplicaGuard closes the remaining window, as with
//     local polls.
//
// Falling back, by itself. A node of which no feed observation has been
// merged for FeedConfig.SilenceBound (default half of StalenessBound) is
// polled by the router until the feed covers it again, so it never goes
// stale because a publisher stopped, cannot reach it, names it otherwise
// or sends what is not believed. When the subscription is not healthy
// (feed.StateSilent, StateUnreachable, StateDropped) every node is polled;
// the router returns to the feed when it is subscribed again. Each switch
// is logged and counted (caughtup.consume.feed.switches by direction and
// state; caughtup.consume.feed.active, caughtup.consume.feed.nodes.local;
// Router.Feed). A router on the feed keeps no connection to any node:
// the one its tracker opened for a node's polls is closed when the feed
// covers the node, and a fallback opens one again.
//
// The fleet budget. Config.FleetBudget (a *feed.Budget: GCRA in Redis,
// shared by every process) bounds the promotions to the primary caused by
// lag or unknown state fleet-wide, per database (key: the database name);
// the per-process cap (PrimaryRate, PrimaryBurst) stays as a local bound,
// and a promotion must pass both. OutcomeCapped then means that the fleet
// budget or the local cap is spent. While Redis cannot answer, the
// per-process cap alone applies, which is logged and counted
// (caughtup.consume.fallback.budget, result unavailable).
package consume
