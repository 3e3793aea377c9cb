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
// error. The handler's context also carries the decision (DecisionFrom)
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
// servers are 15), so a waiting job costs its replica one query per
// WaitPollInterval, shared by every job waiting on it.
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
package consume
