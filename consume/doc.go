// Package consume is the consumer side of caughtup: it decides, for each
// job, which pool the handler reads each database from, so that the job
// sees at least what its producer wrote. It knows no queue; the adapters
// (caughtupasynq, caughtupkafka, caughtupkgo, caughtupriver, caughtuphttp)
// call it.
//
// One Router per process, built from the pools the application has. It
// owns a replay.Tracker, which knows what each replica has replayed, and
// routes every job once against the tracker's snapshot:
//
//	func newRouter(ctx context.Context, primary, replica1, replica2 *pgxpool.Pool) (*consume.Router, error) {
//		return consume.NewRouter(ctx, consume.Config{ // close it when the process ends
//			Databases: map[string]replay.Database{
//				"main": {Primary: primary, Replicas: replay.Replicas(replica1, replica2)},
//			},
//		})
//	}
//
//	// What an adapter does per job: route it, then run the handler with the
//	// context Route returned, or run the job again later.
//	func runJob(ctx context.Context, router *consume.Router, headers []string, handler func(context.Context) error) (retryAfter time.Duration, err error) {
//		tok, decodeErr := position.DecodeHeaders(headers...)
//		ctx, _, err = router.Route(ctx, consume.Job{Token: tok, TokenErr: decodeErr, Policy: consume.Delayed})
//		var de *consume.DeferError
//		if errors.As(err, &de) {
//			return de.Delay, nil // de.Refused(): count the run as a failed attempt
//		}
//		if err != nil {
//			return 0, err
//		}
//		return 0, handler(ctx)
//	}
//
//	// In the handler, the pool chosen for this job:
//	func handle(ctx context.Context, id int64) (string, error) {
//		pool, err := consume.Pool(ctx, "main") // consume.DB panics instead; consume.SQLDB gives a *sql.DB
//		if err != nil {
//			return "", err
//		}
//		var email string
//		err = pool.QueryRow(ctx, "SELECT email FROM users WHERE id = $1", id).Scan(&email)
//		return email, err
//	}
//
// Decide is the routing rule as a pure function of the policy, the token,
// the snapshot and the clock; Route wraps it with the I/O: a Delayed job
// waits up to Config.WaitBudget for a replica to catch up (woken by the
// tracker's snapshots, not a timer), promotions to the primary caused by
// lag or unknown state pass the per-process cap (Config.PrimaryRate) and
// the fleet budget (Config.FleetBudget), and the decision is counted and
// logged; Router.AllowFallback charges the same cap and budget for a
// primary read made outside Route (caughtuphttp's rejected session
// values). A Job carries what the queue allows: NoDefer and DeferBy for a
// job that cannot be deferred (it then reads the primary, charged), Hold
// for one that cannot be refused either (it waits for a replica or the cap
// in its worker), Verify for a token whose position is necessary but not
// sufficient (a Debezium event). A Tally routes like its Router and adds
// the counts in bulk, for adapters at a high message rate; a job with the
// same token as the one before it, routed against the same snapshot while
// the replica chosen is fresh, repeats that decision and its context
// instead of making both again.
//
// Unknown is infinitely behind: a replica whose position is NULL or
// unreadable, whose last observation is older than the staleness bound,
// whose epoch is unknown, that left recovery, diverged, or that this
// process's handlers cannot use is never chosen. A job with no usable
// token, or with a token of another history, reads the primary and is
// counted. It is never served stale.
//
// Each handler connection is tied to the server the decision judged: the
// Router builds the replica pools it hands out from the configured ones'
// configs, and checks each routed acquire (free on the server judged, one
// query on another, ErrReplicaBehind after three refused). A pool one of
// whose connections reaches several servers from one transaction to the
// next is refused at start (ErrMultiplexedReplica). See docs/design.md.
//
// The handler's context carries the decision (DecisionFrom) and, for jobs
// the handler enqueues, the job's token raised to what the chosen replicas
// had replayed (enqueue.TokenFrom).
//
// # Metrics
//
// OpenTelemetry instruments under ScopeName, from Config.MeterProvider
// (default the global one): caughtup.consume.decisions (by
// caughtup.policy, caughtup.outcome, caughtup.reason),
// caughtup.consume.database.routes, caughtup.consume.wait.duration,
// caughtup.consume.tokens.missing, .tokens.cross_epoch, .tokens.future,
// caughtup.consume.fallback.budget (by caughtup.budget local or fleet and
// caughtup.result allowed, spent or unavailable),
// caughtup.consume.replica.connections (caughtup.result same_server,
// verified or behind) and caughtup.consume.replica.exclusions
// (caughtup.reason unreachable or behind). Outcome and Reason name their
// values in String. The tracker's instruments are package replay's.
//
// # Traces
//
// Spans under ScopeName, from Config.TracerProvider (default the global
// one): SpanRoute around each Route, whose attributes are the decision
// (TraceAttributes), and its child SpanWait while the job waits for a
// replica or is held for the fallback cap, made only when Route's context
// has a span (caughtup's spans join traces, they never start one). The handler's context keeps
// the caller's span. The adapters add SpanDefer and SpanWake, and carry
// the producer's trace context in the job's headers through the
// application's propagators.
package consume
