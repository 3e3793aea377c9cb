package consume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
)

// TrackerApplicationName is the application_name of the tracker's own
// connections, so that they can be told apart in pg_stat_activity.
const TrackerApplicationName = "caughtup-tracker"

// trackerConnKey marks the contexts of the tracker's queries, so that a
// ReplicaGuard installed on the application's pool config (which the
// tracker's pools copy) lets the tracker's connections through: the
// tracker must see a restarted replica as it is.
type trackerConnKey struct{}

// tracker polls every node with its own one-connection pool, so its
// queries never queue behind handlers on the application's pools. Each
// poll produces an observation; apply merges it into the snapshot
// (mergePrimary, mergeReplica) and publishes an immutable Snapshot.
type tracker struct {
	cfg *Config
	log *slog.Logger
	met *trackerMetrics

	mu   sync.Mutex // serializes publishers; readers use snap
	snap atomic.Pointer[Snapshot]

	replicas [][]*replicaPoller // by database index, then replica index
	primarys []*primaryPoller

	queries queryCounter

	// feed, when Config.Feed is set, lets the feed replace the pollers'
	// queries (feed.go); nil otherwise.
	feed *feedState
	// sink, for a Publisher, receives every observation after its merge.
	sink observationSink

	warnImpossible rate.Sometimes

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	initLeft atomic.Int32
	initDone chan struct{}
}

type replicaPoller struct {
	db, idx int
	dbName  string
	name    string
	pool    *pgxpool.Pool
	guard   *ReplicaGuard

	// waiters counts jobs waiting on this replica; above zero the poller
	// polls every WaitPollInterval. kick wakes it when the first one
	// arrives, no sooner than WaitPollInterval after its last poll.
	waiters atomic.Int32
	kick    chan struct{}
	// queries counts this replica's polls.
	queries atomic.Uint64
}

type primaryPoller struct {
	db     int
	dbName string
	pool   *pgxpool.Pool
	// kick wakes the poller to look at its schedule again (the feed
	// stopped covering the node).
	kick chan struct{}

	// The history is read once per timeline.
	histTLI    uint32
	hist       position.History
	histKnown  bool
	histDenied bool
}

// trackerOptions are what a Publisher's tracker does differently from a
// Router's.
type trackerOptions struct {
	// rounds polls each database's replicas together and then its
	// primary, once per PollInterval (runRounds), instead of each node on
	// its own schedule.
	rounds bool
	// sink receives every observation after it is merged.
	sink observationSink
	// queries counts the tracker's queries.
	queries queryCounter
}

// observationSink receives a tracker's observations (a Publisher's).
type observationSink interface {
	replica(p *replicaPoller, o ReplicaObservation)
	primary(p *primaryPoller, o PrimaryObservation)
}

func newTracker(cfg *Config, log *slog.Logger, queries queryCounter) (*tracker, error) {
	return newTrackerWith(cfg, log, trackerOptions{queries: queries})
}

func newTrackerWith(cfg *Config, log *slog.Logger, opts trackerOptions) (*tracker, error) {
	names := make([]string, 0, len(cfg.Databases))
	for name := range cfg.Databases {
		names = append(names, name)
	}
	sort.Strings(names)

	t := &tracker{cfg: cfg, log: log, queries: opts.queries, sink: opts.sink, initDone: make(chan struct{}),
		warnImpossible: rate.Sometimes{First: 3, Interval: 10 * time.Second}}
	t.ctx, t.cancel = context.WithCancel(context.WithValue(context.Background(), trackerConnKey{}, true))
	snap := &Snapshot{Databases: make([]DatabaseState, len(names)), changed: make(chan struct{})}
	var (
		pools   []*pgxpool.Pool
		adopted []*ReplicaGuard
	)
	fail := func(err error) (*tracker, error) {
		t.cancel()
		for _, p := range pools {
			p.Close()
		}
		for _, g := range adopted {
			g.release(t)
		}
		return nil, err
	}
	for i, name := range names {
		db := cfg.Databases[name]
		ds := &snap.Databases[i]
		ds.Name = name
		ds.Replicas = make([]ReplicaState, len(db.Replicas))
		pp, err := trackerPool(db.Primary)
		if err != nil {
			return fail(fmt.Errorf("caughtup/consume: tracker pool for database %q primary: %w", name, err))
		}
		pools = append(pools, pp)
		t.primarys = append(t.primarys, &primaryPoller{db: i, dbName: name, pool: pp, kick: make(chan struct{}, 1)})
		var rps []*replicaPoller
		for j, r := range db.Replicas {
			ds.Replicas[j].Name = r.Name
			rp, err := trackerPool(r.Pool)
			if err != nil {
				return fail(fmt.Errorf("caughtup/consume: tracker pool for database %q replica %q: %w", name, r.Name, err))
			}
			pools = append(pools, rp)
			p := &replicaPoller{db: i, idx: j, dbName: name, name: r.Name, pool: rp, guard: r.Guard, kick: make(chan struct{}, 1)}
			if r.Guard != nil {
				if err := r.Guard.adopt(t, p); err != nil {
					return fail(fmt.Errorf("caughtup/consume: database %q replica %q: %w", name, r.Name, err))
				}
				adopted = append(adopted, r.Guard)
			}
			rps = append(rps, p)
		}
		t.replicas = append(t.replicas, rps)
	}
	t.snap.Store(snap)
	var err error
	if t.met, err = newTrackerMetrics(cfg.MeterProvider, t); err != nil {
		return fail(fmt.Errorf("caughtup/consume: creating the tracker's instruments: %w", err))
	}

	if cfg.Feed != nil {
		if t.feed, err = newFeedState(t); err != nil {
			t.met.close()
			return fail(err)
		}
	}

	n := len(t.primarys)
	for _, rps := range t.replicas {
		n += len(rps)
	}
	t.initLeft.Store(int32(n))
	if opts.rounds {
		for db := range t.primarys {
			t.wg.Add(1)
			go t.runRounds(db)
		}
		return t, nil
	}
	for _, p := range t.primarys {
		t.wg.Add(1)
		go t.runPrimary(p)
	}
	for _, rps := range t.replicas {
		for _, p := range rps {
			t.wg.Add(1)
			go t.runReplica(p)
		}
	}
	if t.feed != nil {
		t.feed.start()
	}
	return t, nil
}

// trackerPool copies the application's pool config (hooks included, so
// credentials rotate the same way) into a pool of one connection, named
// TrackerApplicationName.
func trackerPool(p *pgxpool.Pool) (*pgxpool.Pool, error) {
	c := p.Config()
	c.MaxConns, c.MinConns, c.MinIdleConns = 1, 0, 0
	if c.ConnConfig.RuntimeParams == nil {
		c.ConnConfig.RuntimeParams = make(map[string]string)
	}
	c.ConnConfig.RuntimeParams["application_name"] = TrackerApplicationName
	return pgxpool.NewWithConfig(context.Background(), c)
}

func (t *tracker) close() {
	t.cancel()
	t.wg.Wait()
	t.met.close()
	if t.feed != nil {
		t.feed.close()
	}
	for _, p := range t.primarys {
		p.pool.Close()
	}
	for _, rps := range t.replicas {
		for _, p := range rps {
			p.pool.Close()
			if p.guard != nil {
				p.guard.release(t)
			}
		}
	}
}

func (t *tracker) snapshot() *Snapshot { return t.snap.Load() }

func (t *tracker) initialized() {
	if t.initLeft.Add(-1) == 0 {
		close(t.initDone)
	}
}

// publish replaces the snapshot with one whose database db is ds, then
// wakes everything waiting on the old one. t.mu must be held.
func (t *tracker) publish(old *Snapshot, db int, ds DatabaseState) {
	ns := &Snapshot{Seq: old.Seq + 1, Databases: slices.Clone(old.Databases), changed: make(chan struct{})}
	ns.Databases[db] = ds
	t.snap.Store(ns)
	close(old.changed)
}

// nextPoll is when the poll after one that started at last is due: one
// PollInterval later, or one WaitPollInterval later while jobs wait. Polls
// of one node are never closer than WaitPollInterval, however many jobs
// wait and however often they arrive: that is the bound on the load
// waiting puts on a replica.
func nextPoll(last time.Time, waiting bool, cfg *Config) time.Time {
	if waiting {
		return last.Add(cfg.WaitPollInterval)
	}
	return last.Add(cfg.PollInterval)
}

func (t *tracker) runReplica(p *replicaPoller) {
	var fed func() time.Time
	if t.feed != nil {
		n := t.feed.replicas[p.db][p.idx]
		fed = func() time.Time { return t.feed.fedUntil(n) }
	}
	t.run(func() { t.pollReplica(p) }, func() bool { return p.waiters.Load() > 0 }, p.kick, fed)
}

func (t *tracker) runPrimary(p *primaryPoller) {
	var fed func() time.Time
	if t.feed != nil {
		n := t.feed.primarys[p.db]
		fed = func() time.Time { return t.feed.fedUntil(n) }
	}
	t.run(func() { t.pollPrimary(p) }, func() bool { return false }, p.kick, fed)
}

// run polls on the schedule of nextPoll (measured from the start of each
// poll, so that a slow query does not stretch the period) until the
// tracker stops, and marks the node initialized after its first poll. A
// kick (a first waiter, or the feed lapsing) makes it look at the schedule
// again. While fed reports the node covered by the feed (a time until
// which it is), it does not poll at all, waiters or not: the feed's
// publishers set the pace.
func (t *tracker) run(poll func(), waiting func() bool, kick chan struct{}, fed func() time.Time) {
	defer t.wg.Done()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	first := true
	for {
		start := time.Now()
		poll()
		if first {
			first = false
			t.initialized()
		}
		for {
			due := nextPoll(start, waiting(), t.cfg)
			if fed != nil {
				if until := fed(); !until.IsZero() {
					due = until
				}
			}
			d := time.Until(due)
			if d <= 0 {
				if t.ctx.Err() != nil {
					return
				}
				break
			}
			timer.Reset(d)
			select {
			case <-t.ctx.Done():
				timer.Stop()
				return
			case <-timer.C:
			case <-kick:
				timer.Stop()
			}
		}
	}
}

// observeReplica polls a replica once.
func (t *tracker) observeReplica(p *replicaPoller) (ReplicaObservation, bool) {
	o := ReplicaObservation{ObservedAt: t.cfg.Now()}
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.StalenessBound)
	r, err := pgwal.ReadReplica(ctx, p.pool, pgwal.Control|pgwal.Status)
	cancel()
	o.ReadBy = t.cfg.Now()
	t.queries.Add(1)
	p.queries.Add(1)
	if t.ctx.Err() != nil {
		return o, false // shutting down: not an observation
	}
	if err != nil {
		o.Err = err
		return o, true
	}
	o.Incarnation, o.InRecovery = r.Incarnation(), r.InRecovery
	if r.InRecovery {
		// Without a running WAL receiver the timeline the replay belongs
		// to is not known for sure (the checkpoint's timeline lags a
		// promotion), so the epoch stays unknown and the replica is never
		// caught up until the receiver is back.
		o.Replayed.LSN = r.LSN
		if r.Timeline != 0 {
			o.Replayed.Epoch = r.Replayed().Epoch
		}
	}
	o.ReplayTimestamp = r.ReplayTimestamp
	if r.TimeLagKnown {
		o.TimeLag = r.TimeLag
	}
	return o, true
}

func (t *tracker) pollReplica(p *replicaPoller) {
	if o, ok := t.observeReplica(p); ok {
		t.applyReplica(p, o)
		if t.sink != nil {
			t.sink.replica(p, o)
		}
	}
}

// applyReplica merges one observation of a replica and publishes the
// result. The guard's source (the snapshot) is updated in the same step,
// so that HighestReplayed is never behind a position a decision can use.
func (t *tracker) applyReplica(p *replicaPoller, o ReplicaObservation) {
	t.mu.Lock()
	if t.feed != nil {
		t.feed.polledReplica(p.db, p.idx, &o)
	}
	prev, next, ch := t.mergeReplicaLocked(p.db, p.idx, o)
	t.mu.Unlock()
	t.reportReplica(p.db, p.idx, prev, next, ch)
}

// mergeReplicaLocked merges o into replica idx of database db and
// publishes the result; t.mu must be held.
func (t *tracker) mergeReplicaLocked(db, idx int, o ReplicaObservation) (prev, next ReplicaState, ch replicaChange) {
	old := t.snap.Load()
	ds := old.Databases[db]
	ds.Replicas = slices.Clone(ds.Replicas)
	prev = ds.Replicas[idx]
	next, ch = mergeReplica(prev, o, &ds.Primary, t.cfg)
	ds.Replicas[idx] = next
	t.publish(old, db, ds)
	return prev, next, ch
}

// reportReplica logs and counts what a merge changed.
func (t *tracker) reportReplica(db, idx int, prev, next ReplicaState, ch replicaChange) {
	t.reportMerge(db, idx, prev, next, ch)
	t.reportDiverged(db, prev, next)
}

// reportMerge is reportReplica but for divergence.
func (t *tracker) reportMerge(db, idx int, prev, next ReplicaState, ch replicaChange) {
	dbName := t.primarys[db].dbName
	attrs := func(extra ...any) []any {
		return append([]any{slog.String(attrDatabase, dbName), slog.String(attrReplica, next.Name)}, extra...)
	}
	t.met.replicaChange(db, idx, ch)
	switch {
	case ch.impossible:
		// Rate-limited: with a feed, a faulty publisher can send many.
		t.warnImpossible.Do(func() {
			t.log.Warn("caughtup: impossible replica observation (replay ahead of the primary's insert position); the replica counts as unknown (logged at most every 10s; see caughtup.consume.tracker.observations.rejected)",
				attrs()...)
		})
	case ch.failed:
		t.log.Warn("caughtup: replica unreadable; not used until it answers", attrs(slog.Any("error", next.Err))...)
	case ch.recovered:
		t.log.Info("caughtup: replica readable again", attrs()...)
	}
	if ch.restarted {
		t.log.Warn("caughtup: replica restarted; it counts as behind until it replays what it had before (it may show less)",
			attrs(slog.String("restart_floor", next.RestartFloor.String()), slog.String("replayed", next.Replayed.LSN.String()))...)
	}
	if ch.released {
		t.log.Info("caughtup: restarted replica has replayed what it had before; used again", attrs()...)
	}
	if next.Observations > 0 && !next.InRecovery && (ch.leftRecovery || prev.Observations == 0 || ch.restarted) {
		t.log.Warn("caughtup: node is not in recovery (promoted?); it is no longer used as a replica", attrs()...)
	}
}

func (t *tracker) reportDiverged(db int, prev, next ReplicaState) {
	if prev.Diverged == next.Diverged {
		return
	}
	attrs := []any{slog.String(attrDatabase, t.primarys[db].dbName), slog.String(attrReplica, next.Name)}
	if next.Diverged {
		p := t.snapshot().Databases[db].Primary
		t.log.Warn("caughtup: diverged standby: it replayed past the point where the primary's timeline left its own, so it holds WAL the primary lacks; no job reads or waits on it until it is rebuilt (pg_rewind or a new base backup) and follows the primary",
			append(attrs, slog.String("replica_epoch", next.Replayed.Epoch.String()), slog.String("replayed", next.Replayed.LSN.String()),
				slog.String("primary_epoch", p.Epoch.String()))...)
		return
	}
	t.log.Info("caughtup: standby no longer diverged", attrs...)
}

// observePrimary polls a primary once, reading the timeline history when
// the timeline is new to the poller.
func (t *tracker) observePrimary(p *primaryPoller) (PrimaryObservation, bool) {
	o := PrimaryObservation{ObservedAt: t.cfg.Now()}
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.StalenessBound)
	defer cancel()
	r, err := pgwal.ReadPrimary(ctx, p.pool, pgwal.Control)
	t.queries.Add(1)
	if t.ctx.Err() != nil {
		return o, false
	}
	if err != nil {
		o.Err = err
		return o, true
	}
	if r.Timeline != p.histTLI {
		p.histTLI, p.hist, p.histKnown, p.histDenied = r.Timeline, nil, r.Timeline == 1, false
	}
	if !p.histKnown && !p.histDenied {
		t.readHistory(ctx, p)
	}
	o.Epoch, o.InsertLSN, o.WAL = r.Epoch(), r.InsertLSN, r.Control.WAL
	o.History, o.HistoryKnown = p.hist, p.histKnown
	return o, true
}

func (t *tracker) pollPrimary(p *primaryPoller) {
	if o, ok := t.observePrimary(p); ok {
		t.applyPrimary(p.db, o, false)
		if t.sink != nil {
			t.sink.primary(p, o)
		}
	}
}

// applyPrimary merges one observation of a primary (fromFeed: delivered by
// the feed, else the tracker's own poll), re-derives its replicas' states
// (rules 4 and 5), merges the feed's replica observations that waited for
// it, and publishes the result.
func (t *tracker) applyPrimary(db int, o PrimaryObservation, fromFeed bool) {
	t.mu.Lock()
	if t.feed != nil && !fromFeed {
		t.feed.polledPrimary(db, &o)
	}
	old := t.snap.Load()
	ds := old.Databases[db]
	prev := ds.Primary
	var ch primaryChange
	ds.Primary, ch = mergePrimary(prev, o)
	ds.Replicas = slices.Clone(ds.Replicas)
	prevReplicas := old.Databases[db].Replicas
	var bad []int
	for i := range ds.Replicas {
		var impossible bool
		if ds.Replicas[i], impossible = recheckReplica(ds.Replicas[i], &ds.Primary, t.cfg); impossible {
			bad = append(bad, i)
		}
	}
	var waited []pendingMerge
	if t.feed != nil {
		waited = t.feed.mergePending(db, &ds)
	}
	t.publish(old, db, ds)
	t.mu.Unlock()
	for _, m := range waited {
		// Divergence is reported below, from the state before this merge.
		t.reportMerge(db, m.idx, m.prev, m.next, m.ch)
	}

	dbName := t.primarys[db].dbName
	switch {
	case ch.failed:
		t.log.Warn("caughtup: primary unreadable; its epoch is unknown and replica lag unmeasured",
			slog.String(attrDatabase, dbName), slog.Any("error", ds.Primary.Err))
	case ch.recovered:
		t.log.Info("caughtup: primary readable again", slog.String(attrDatabase, dbName))
	}
	if ch.epochChanged {
		t.log.Warn("caughtup: primary epoch changed",
			slog.String(attrDatabase, dbName), slog.String("from", prev.Epoch.String()), slog.String("to", ds.Primary.Epoch.String()),
			slog.Bool("history_known", ds.Primary.HistoryKnown))
	}
	if ch.superseded {
		t.log.Warn("caughtup: the primary reports an older timeline than already seen (a former primary?); its observations are ignored",
			slog.String(attrDatabase, dbName), slog.String("seen", ds.Primary.Epoch.String()), slog.String("reported", o.Epoch.String()))
	}
	t.met.primaryChange(db, ch)
	for _, i := range bad {
		t.met.replicaChange(db, i, replicaChange{impossible: true})
		t.log.Warn("caughtup: a replica's replay position is ahead of its primary's insert position; the replica counts as unknown",
			slog.String(attrDatabase, dbName), slog.String(attrReplica, ds.Replicas[i].Name))
	}
	for i := range ds.Replicas {
		t.reportDiverged(db, prevReplicas[i], ds.Replicas[i])
	}
}

// readHistory reads the timeline history file. Without it, tokens from
// older timelines cannot be placed and read the primary, and diverged
// standbys cannot be recognized; with no right to read it it is not asked
// for again on this timeline.
func (t *tracker) readHistory(ctx context.Context, p *primaryPoller) {
	h, err := pgwal.ReadHistory(ctx, p.pool, p.histTLI)
	t.queries.Add(1)
	if err == nil {
		p.hist, p.histKnown = h, true
		return
	}
	p.histDenied = errors.Is(err, pgwal.ErrHistoryDenied)
	t.log.Warn("caughtup: cannot read the timeline history; tokens from older timelines will read the primary, and a standby left on an older timeline is not recognized as diverged",
		slog.String(attrDatabase, p.dbName), slog.Uint64("timeline", uint64(p.histTLI)), slog.Any("error", err))
}

// watch makes the pollers of the given replicas poll every
// WaitPollInterval until the returned function is called. Replicas that
// cannot catch up with any token (diverged, promoted) are not sped up.
func (t *tracker) watch(db int, replicas []int) func() {
	var ps []*replicaPoller
	states := t.snapshot().Databases[db].Replicas
	for _, i := range replicas {
		if st := &states[i]; st.Diverged || (st.Observations > 0 && !st.InRecovery) {
			continue
		}
		p := t.replicas[db][i]
		ps = append(ps, p)
		if p.waiters.Add(1) == 1 {
			select {
			case p.kick <- struct{}{}:
			default:
			}
		}
	}
	return func() {
		for _, p := range ps {
			p.waiters.Add(-1)
		}
	}
}
