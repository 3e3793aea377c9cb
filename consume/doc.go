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
package consume
