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
//	// In the queue adapter, per job:
//	ctx, d, err := router.Route(ctx, headers[position.HeaderName], consume.PolicyDefault)
//	var de *consume.DeferError
//	if errors.As(err, &de) { ... run the job again after de.Delay ... }
//
//	// In the handler:
//	rows, err := consume.DB(ctx, "main").Query(ctx, "SELECT ...")
//
// Unknown is infinitely behind: a replica whose position is NULL, whose
// query failed, whose last observation is older than
// Config.StalenessBound, whose epoch is unknown or that has left recovery
// is never chosen. When no replica can serve a job it reads the primary,
// unless the policy lets it wait or be deferred, or the fallback cap
// (Config.PrimaryRate) refuses the promotion; it is never served stale.
//
// Waiting polls: PostgreSQL 19's WAIT FOR LSN is not used yet (these
// servers are 15), so a waiting job costs its replica one query per
// WaitPollInterval, shared by every job waiting on it.
//
// Tokens carry end positions, so "caught up" is replay ≥ token within one
// epoch, or across a failover only up to the switchpoint. Positions that
// the new history does not contain (a write lost in an asynchronous
// failover or crash) cannot be detected by any token: handlers must
// tolerate a row that is not found.
package consume
