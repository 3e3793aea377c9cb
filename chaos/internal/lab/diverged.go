package lab

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The diverged-standby scenario is a failover whose old primary was not
// fenced. On a cluster of its own (a primary and three replicas):
//
//  1. A split-brain producer, a client that still has the old primary's
//     address, writes rows of its own (keys above splitKeyBase) on the
//     old primary from the start, beside the main producers.
//  2. At the fault the main producers and the router's primary pool are
//     moved to replica1 (their pools connect to whatever dbEnv.movePrimary
//     names, read-write only); their connections to the old primary are
//     terminated, and replica1 replays everything the old primary had by
//     then. So every main write is in the new timeline's history. The
//     split-brain producer is held during this switch (see below).
//  3. replica1 is promoted alone (pgtest.Cluster.PromoteAlone: the old
//     primary keeps running, and replica2 keeps following it); replica3 is
//     re-pointed at replica1 (Node.Follow), as an orchestrator re-points
//     the standbys it knows of.
//  4. Once the router's tracker knows the new timeline and its history,
//     and replica3 no longer receives WAL from the old primary (else it
//     would diverge too), the split-brain producer resumes on the old
//     primary: those writes exist only in the lost history, and replica2
//     replays them past the switchpoint, which makes it a diverged
//     standby.
//  5. Once the tracker reports replica2 diverged, replica3 is stopped for
//     a while: nothing but the diverged standby is left, so a job with a
//     new-timeline token must read the primary at once rather than wait.
//
// Why the split-brain producer is held from the switch until the tracker
// knows the new timeline: until then the router's view of the primary is
// the old one (or none), and a write on the old primary is, as far as any
// observer in this process can tell, an ordinary write on timeline 1 that
// replica2 has replayed. No router can tell a diverged standby before it
// knows the new history; the scenario checks everything after that.
//
// Stale, for a row of the split-brain producer: its versions after the
// switch exist only in the lost history. If nv is the row's version on the
// new primary at the end (0 when missing), a job that wrote version v must
// read min(v, nv): more is a read of a diverged server (a version the new
// timeline never had), less an ordinary stale read. A job whose write is
// lost (v > nv) therefore must read exactly nv. Main rows have no lost
// versions (step 2 makes sure, and the judge checks the old primary's copy
// of them did not change after the switch), so the ordinary rule applies.
func divergedStandbyScenario(sl scale) *scenario {
	return &scenario{
		name: "diverged-standby",
		about: fmt.Sprintf("on a cluster of its own, replica1 promoted alone (the old primary keeps running and replica2 keeps following it, "+
			"replica3 re-pointed at replica1); a split-brain client writes on the old primary until %s, so replica2 replays past the "+
			"switchpoint; then replica3 stopped for %s, leaving only the diverged standby; 40%% of main jobs enqueued 0.2-3s late",
			sl.lead+2*sl.down, sl.down),
		fresh:    true,
		replicas: 3,
		// A standby re-pointed at the new primary restarts its WAL
		// receiver, more than once when it must switch timelines, and
		// waits wal_retrieve_retry_interval (5s) before each attempt; the
		// re-pointing took 10s in one run of three.
		settings:       map[string]string{"wal_retrieve_retry_interval": "200ms"},
		movablePrimary: true,
		policy:         consume.Delayed,
		delay:          lateEnqueue,
		span:           func(s scale) time.Duration { return s.span(s.lead + 2*s.down + s.tail) },
		prepare:        prepareSplitBrain,
		fault:          divergeStandby,
		judge:          judgeDiverged,
		check:          checkDiverged,
	}
}

const (
	// splitKeyBase and splitIDBase put the split-brain producer's rows and
	// job ids apart from the main producers'.
	splitKeyBase = 1 << 40
	splitIDBase  = 1 << 40
	// splitRate is the split-brain producer's jobs per second.
	splitRate = 40
	// splitApp is the split-brain pool's application_name, which the
	// switch does not terminate.
	splitApp = "chaos-split-brain"
)

// divergedState is the scenario's bookkeeping.
type divergedState struct {
	old                 *pgtest.Node // the old primary
	promoted, diverging *pgtest.Node // replica1, replica2
	follower            *pgtest.Node // replica3
	split               *workload
	splitPool           *pgxpool.Pool
	gate                sync.RWMutex
	gateClosed          bool

	mu sync.Mutex
	// Main rows on the old primary when the switch had cut the main
	// producers off; the judge compares them again at the end.
	fenceRows, fenceSum int64
	switchpoint         position.LSN
	promoted0, promoted1,
	trackerKnew, resumed, divergedAt,
	outageFrom, outageTo time.Time
	// What the judge found.
	lostJobs, lostDiverged int
	lostOutcomes           map[string]int
	fenceChanged           bool
}

func divergedOf(r *run) *divergedState {
	st, _ := r.state.(*divergedState)
	return st
}

func prepareSplitBrain(ctx context.Context, r *run) error {
	c := r.cluster
	reps := c.Replicas()
	if len(reps) < 3 {
		return fmt.Errorf("the scenario needs 3 replicas, the cluster has %d", len(reps))
	}
	st := &divergedState{old: c.Primary(), promoted: reps[0], diverging: reps[1], follower: reps[2], lostOutcomes: map[string]int{}}
	cfg, err := pgxpool.ParseConfig(st.old.DSN(r.env.name))
	if err != nil {
		return err
	}
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["application_name"] = splitApp
	if st.splitPool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return err
	}
	r.closers = append(r.closers, st.splitPool.Close)
	over := r.sl.lead + 2*r.sl.down
	st.split = &workload{
		pool: st.splitPool, jobs: int(splitRate * over.Seconds()), over: over, workers: 2, keys: 50,
		idBase: splitIDBase, keyBase: splitKeyBase, gate: &st.gate, lanes: r.work.lanes,
	}
	r.extra = append(r.extra, st.split)
	r.state = st
	return nil
}

func divergeStandby(ctx context.Context, r *run) error {
	st := divergedOf(r)
	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	// Hold the split-brain producer: its writes under way finish first.
	st.gate.Lock()
	st.gateClosed = true
	defer func() {
		if st.gateClosed {
			st.gate.Unlock()
		}
	}()
	if err := switchMainProducers(ctx, r, st); err != nil {
		return err
	}

	st.mu.Lock()
	st.promoted0 = time.Now()
	st.mu.Unlock()
	old, err := r.cluster.PromoteAlone(ctx, st.promoted)
	if err != nil {
		return fmt.Errorf("promote %s alone: %w", st.promoted.Name(), err)
	}
	st.mu.Lock()
	st.promoted1 = time.Now()
	st.mu.Unlock()
	tli, err := st.promoted.Timeline(ctx)
	if err != nil {
		return err
	}
	r.event("promoted %s alone (timeline %d) in %s; %s keeps running, %s keeps following it",
		st.promoted.Name(), tli, st.promoted1.Sub(st.promoted0).Round(time.Millisecond), old.Name(), st.diverging.Name())
	// replica3 is re-pointed meanwhile; how long that takes is
	// PostgreSQL's and pgtest's business (a reload, else a restart).
	followed := make(chan error, 1)
	var followTook time.Duration
	go func() {
		began := time.Now()
		err := st.follower.Follow(ctx, st.promoted)
		followTook = time.Since(began)
		followed <- err
	}()

	// The router's tracker must see the new primary and its history.
	var ds *replay.DatabaseState
	if !r.waitTracker(ctx, 30*time.Second, func(db *replay.DatabaseState) bool {
		ds = db
		return db.Primary.Err == nil && db.Primary.Epoch.Timeline == tli && db.Primary.HistoryKnown
	}) {
		return fmt.Errorf("the router's tracker did not see timeline %d with its history within 30s", tli)
	}
	sp, ok := ds.Primary.History.Switchpoint(tli - 1)
	if !ok {
		return fmt.Errorf("timeline %d's history has no switchpoint for timeline %d", tli, tli-1)
	}
	st.mu.Lock()
	st.trackerKnew, st.switchpoint = time.Now(), sp
	st.mu.Unlock()
	r.event("tracker: primary on timeline %d, history known (switchpoint %s), %s after the promotion", tli, sp, st.trackerKnew.Sub(st.promoted1).Round(time.Millisecond))

	// replica3 must not stream the old primary's new writes, or it
	// diverges too.
	if err := waitNotStreamingFrom(ctx, st.follower, st.old); err != nil {
		return err
	}
	st.gateClosed = false
	st.gate.Unlock()
	st.mu.Lock()
	st.resumed = time.Now()
	st.mu.Unlock()
	r.event("split-brain client resumes writing on the old primary (%s): every write from here on exists only in the lost history", old.Name())

	idx := 1 // replica2 in env.replicas
	if !r.waitTracker(ctx, 30*time.Second, func(db *replay.DatabaseState) bool {
		ds = db
		return db.Replicas[idx].Diverged
	}) {
		return fmt.Errorf("the tracker did not report %s diverged within 30s", st.diverging.Name())
	}
	st.mu.Lock()
	st.divergedAt = time.Now()
	st.mu.Unlock()
	rs := ds.Replicas[idx]
	r.event("tracker: %s diverged, %s after the split-brain writes resumed (replayed %s on timeline %d, switchpoint %s)",
		st.diverging.Name(), st.divergedAt.Sub(st.resumed).Round(time.Millisecond), rs.Replayed.LSN, rs.Replayed.Epoch.Timeline, sp)

	select {
	case err := <-followed:
		if err != nil {
			return fmt.Errorf("re-point %s: %w", st.follower.Name(), err)
		}
	case <-ctx.Done():
		return ctx.Err()
	}
	r.event("%s follows %s on timeline %d (re-pointed in %s)", st.follower.Name(), st.promoted.Name(), tli, followTook.Round(time.Millisecond))

	// Only the diverged standby left: new-timeline jobs must not wait on it.
	if err := r.at(ctx, r.sl.lead+r.sl.down); err != nil {
		return err
	}
	if err := st.follower.Stop(ctx); err != nil {
		return fmt.Errorf("stop %s: %w", st.follower.Name(), err)
	}
	if _, ok := r.watchReplica(ctx, 2, true); !ok {
		return fmt.Errorf("the tracker did not notice %s stopping", st.follower.Name())
	}
	st.mu.Lock()
	st.outageFrom = time.Now()
	st.mu.Unlock()
	r.event("stopped %s; tracker marks it unreadable: only the diverged %s is left", st.follower.Name(), st.diverging.Name())
	if !sleepCtx(ctx, r.sl.down) {
		return ctx.Err()
	}
	st.mu.Lock()
	st.outageTo = time.Now()
	st.mu.Unlock()
	if err := st.follower.Start(ctx); err != nil {
		return fmt.Errorf("start %s: %w", st.follower.Name(), err)
	}
	r.event("started %s again (streaming from %s)", st.follower.Name(), st.promoted.Name())
	return nil
}

// switchMainProducers moves the main producers and the router's primary
// pool to the replica about to be promoted and cuts their connections to
// the old primary, then waits until that replica has replayed everything
// the old primary had: after it no main write can be lost.
func switchMainProducers(ctx context.Context, r *run, st *divergedState) error {
	r.env.movePrimary(st.promoted)
	ctl, err := pgx.Connect(ctx, st.old.DSN(""))
	if err != nil {
		return err
	}
	defer ctl.Close(context.Background())
	// Terminate until a pass finds nobody: a connection dialled just
	// before the move may arrive after the first pass.
	for clean := 0; clean < 2; {
		var n int
		if err := ctl.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = $1 AND application_name <> $2 AND pid <> pg_backend_pid()`, r.env.name, splitApp).Scan(&n); err != nil {
			return fmt.Errorf("terminate the main producers' connections on %s: %w", st.old.Name(), err)
		}
		if n == 0 {
			clean++
		} else {
			clean = 0
		}
		sleepCtx(ctx, 50*time.Millisecond)
	}
	var rows, sum int64
	if err := st.splitPool.QueryRow(ctx, `SELECT count(*), coalesce(sum(version), 0) FROM items WHERE id < $1`, int64(splitKeyBase)).Scan(&rows, &sum); err != nil {
		return err
	}
	var fence string
	if err := ctl.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&fence); err != nil {
		return err
	}
	if err := st.promoted.WaitReplay(ctx, fence); err != nil {
		return fmt.Errorf("%s did not replay the old primary's %s: %w", st.promoted.Name(), fence, err)
	}
	st.mu.Lock()
	st.fenceRows, st.fenceSum = rows, sum
	st.mu.Unlock()
	r.event("main producers and the router's primary pool moved to %s; their connections to %s terminated; %s replayed the old primary's %s",
		st.promoted.Name(), st.old.Name(), st.promoted.Name(), fence)
	return nil
}

// waitNotStreamingFrom waits until n's WAL receiver is not connected to
// from (stopped, restarting or connected elsewhere): from then on n
// receives nothing from it.
func waitNotStreamingFrom(ctx context.Context, n, from *pgtest.Node) error {
	deadline := time.Now().Add(30 * time.Second)
	last := "not asked"
	for time.Now().Before(deadline) && ctx.Err() == nil {
		port, err := senderPort(ctx, n)
		switch {
		case err == nil && port != from.Port():
			return nil
		case err == nil:
			last = fmt.Sprintf("streaming from :%d", port)
		default:
			last = err.Error()
		}
		sleepCtx(ctx, 20*time.Millisecond)
	}
	return fmt.Errorf("%s still receives WAL from %s after 30s (%s)", n.Name(), from.Name(), last)
}

// senderPort is the port n's WAL receiver is connected to, 0 without one.
func senderPort(ctx context.Context, n *pgtest.Node) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, n.DSN(""))
	if err != nil {
		return 0, err
	}
	defer c.Close(context.Background())
	var port int
	err = c.QueryRow(ctx, `SELECT coalesce(sender_port, 0) FROM pg_stat_wal_receiver`).Scan(&port)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	return port, err
}

// waitTracker polls the router's snapshot of "main" until ok accepts it.
func (r *run) waitTracker(ctx context.Context, limit time.Duration, ok func(db *replay.DatabaseState) bool) bool {
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if db := r.env.router.Snapshot().Database("main"); db != nil && ok(db) {
			return true
		}
		sleepCtx(ctx, 10*time.Millisecond)
	}
	return false
}

// judgeDiverged applies the scenario's staleness rule to the split-brain
// producer's rows (see divergedStandbyScenario) and checks that no main
// row changed on the old primary after the switch.
func judgeDiverged(ctx context.Context, r *run) error {
	st := divergedOf(r)
	if st == nil || st.trackerKnew.IsZero() {
		return nil // the fault failed early and said so
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	nv := map[int64]int64{}
	rows, err := r.env.primary.Query(ctx, `SELECT id, version FROM items WHERE id > $1`, int64(splitKeyBase))
	if err != nil {
		return fmt.Errorf("read the split-brain rows on the new primary: %w", err)
	}
	for rows.Next() {
		var k, v int64
		if err := rows.Scan(&k, &v); err != nil {
			return err
		}
		nv[k] = v
	}
	if err := rows.Err(); err != nil {
		return err
	}
	var n, sum int64
	if err := st.splitPool.QueryRow(ctx, `SELECT count(*), coalesce(sum(version), 0) FROM items WHERE id < $1`, int64(splitKeyBase)).Scan(&n, &sum); err != nil {
		return fmt.Errorf("read the main rows on the old primary: %w", err)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	st.fenceChanged = n != st.fenceRows || sum != st.fenceSum
	lost := map[int64]bool{}
	for _, s := range r.streams() {
		s.rejudge(func(rd read) (bool, bool) {
			if rd.job.Key <= splitKeyBase {
				return false, false
			}
			want := nv[rd.job.Key]
			got := max(rd.got, 0)
			if rd.job.Version > want {
				if !lost[rd.job.ID] {
					lost[rd.job.ID] = true
					st.lostOutcomes[rd.outcome]++
				}
				if got > want {
					st.lostDiverged++
				}
			}
			return got < min(rd.job.Version, want) || got > want, true
		})
	}
	st.lostJobs = len(lost)
	return nil
}

func checkDiverged(r *run, res *scenarioResult) {
	st := divergedOf(r)
	if st == nil {
		return
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.divergedAt.IsZero() {
		return // the fault failed and said so
	}
	if st.fenceChanged {
		r.fail("a main row changed on the old primary after the switch: main writes were lost and the stale rule for them does not hold")
	}
	r2 := st.diverging.Name()
	var (
		afterFlag, inDetection, oldTL, oldTLStale int
		outageReads, outageWaited, outageReplica  int
		reasons                                   = map[string]int{}
	)
	for _, s := range r.streams() {
		s.mu.Lock()
		for _, rd := range s.reads {
			if rd.replica == r2 && rd.decided.After(st.divergedAt) {
				afterFlag++
				if afterFlag <= 5 {
					r.fail("%s job %d read the diverged %s at %s, %s after the tracker reported it", s.name, rd.job.ID, r2,
						rd.decided.Format("15:04:05.000"), rd.decided.Sub(st.divergedAt).Round(time.Millisecond))
				}
			}
			if rd.replica == r2 && rd.decided.After(st.resumed) && !rd.decided.After(st.divergedAt) {
				inDetection++
			}
			if rd.job.Key < splitKeyBase && time.Unix(0, rd.job.Committed).Before(st.promoted0) && rd.at.After(st.promoted1) {
				oldTL++
				if rd.stale {
					oldTLStale++
				}
			}
			// Decisions begun while replica3 was down: only the diverged
			// standby could have been waited on.
			if began := rd.decided.Add(-rd.waited); rd.timeline > 1 && !began.Before(st.outageFrom) && began.Before(st.outageTo) {
				outageReads++
				reasons[rd.reason]++
				if rd.waited > 0 {
					outageWaited++
				}
				if rd.replica != "" {
					outageReplica++
				}
			}
		}
		s.mu.Unlock()
	}
	r.note("switchpoint %s; the tracker knew the new timeline %s after the promotion and reported %s diverged %s after the split-brain writes resumed",
		st.switchpoint, st.trackerKnew.Sub(st.promoted1).Round(time.Millisecond), r2, st.divergedAt.Sub(st.resumed).Round(time.Millisecond))
	r.note("routes to the diverged %s after the tracker reported it: %d; before that, after the split-brain writes resumed (detection): %d",
		r2, afterFlag, inDetection)
	r.note("split-brain jobs: %d of %d wrote only in the lost history; outcomes %v; %d reads of them showed a version the new timeline never had",
		st.lostJobs, st.split.produced.Load(), st.lostOutcomes, st.lostDiverged)
	r.note("%d reads after the promotion were of main jobs committed on timeline 1 before it; %d of them stale", oldTL, oldTLStale)
	r.note("while %s was down (%s): %d new-timeline decisions, %d waited, %d read a replica; reasons %v",
		st.follower.Name(), st.outageTo.Sub(st.outageFrom).Round(time.Millisecond), outageReads, outageWaited, outageReplica, reasons)
	if afterFlag > 0 {
		r.fail("%d jobs read the diverged standby after the tracker reported it", afterFlag)
	}
	if st.lostJobs == 0 {
		r.fail("no split-brain write was lost: the old primary did not diverge from the new timeline")
	}
	if oldTL == 0 {
		r.fail("no job written on timeline 1 before the promotion was read after it")
	}
	if outageReads == 0 {
		r.fail("no new-timeline job was decided while only the diverged standby was left: not exercised")
	}
	if outageWaited > 0 || outageReplica > 0 {
		r.fail("while only the diverged standby was left, %d new-timeline jobs waited and %d read a replica", outageWaited, outageReplica)
	}
}
