package replay

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

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric/noop"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/internal/retry"
	"github.com/caughtup/caughtup/position"
)

// A Tracker knows what every replica of its databases has replayed. It
// polls every node with its own one-connection pool, so its queries never
// queue behind handlers on the application's pools, or takes the nodes'
// observations from a position feed (TrackerConfig.Feed). Every
// observation is merged into the state (see "How observations merge" in
// the package documentation) and published as an immutable Snapshot.
// consume.Router owns one; the caughtup watch command runs one on its own.
type Tracker struct {
	cfg *TrackerConfig
	dbs map[string]Database
	log *slog.Logger
	met *trackerMetrics

	mu   sync.Mutex // serializes publishers; readers use snap
	snap atomic.Pointer[Snapshot]

	replicas [][]*replicaPoller // by database index, then replica index
	primarys []*primaryPoller

	// feed, when TrackerConfig.Feed is set, lets the feed replace the pollers'
	// queries (feed.go); nil otherwise.
	feed *feedState
	// sink, for a Publisher, receives every observation after its merge.
	sink observationSink

	warnImpossible rate.Sometimes

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	closeOnce sync.Once
	initLeft  atomic.Int32

	// granted remembers the grant warnings logged: each once.
	granted  sync.Map
	initDone chan struct{}
}

type replicaPoller struct {
	db, idx int
	dbName  string
	name    string
	pool    *pgxpool.Pool
	role    string // the role the tracker connects as

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
	role   string // the role the tracker connects as
	// queries counts this primary's polls.
	queries atomic.Uint64
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
	// noMetrics: the tracker records no metrics (a Publisher's: the
	// Routers of its process report the replicas).
	noMetrics bool
}

// observationSink receives a tracker's observations (a Publisher's).
type observationSink interface {
	replica(p *replicaPoller, o ReplicaObservation)
	primary(p *primaryPoller, o PrimaryObservation)
}

// NewTracker validates dbs and cfg, starts polling (or subscribing to the
// feed) and waits until every node has been queried once, or ctx ends, or
// cfg.StalenessBound passes: nodes that have not answered by then count as
// unknown until they do. On a feed (cfg.Feed) only the primaries are
// queried at start: a replica is identified when the tracker is first
// asked about its positions (Snapshot, Watch), so that a fleet started at
// once opens no connection to its replicas before a job needs one (see
// FeedConfig). ctx bounds only this start; the Tracker runs until Close.
// The pools in dbs stay the caller's.
func NewTracker(ctx context.Context, dbs map[string]Database, cfg TrackerConfig) (*Tracker, error) {
	cfg = cfg.WithDefaults()
	if err := ValidateDatabases(dbs); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	t, err := newTracker(dbs, &cfg, trackerOptions{})
	if err != nil {
		return nil, err
	}
	bound := time.NewTimer(cfg.StalenessBound)
	defer bound.Stop()
	select {
	case <-t.initDone:
	case <-bound.C:
		t.log.Warn("caughtup: not every node answered the tracker in time; jobs read the primary until they do",
			slog.Duration("waited", cfg.StalenessBound))
	case <-ctx.Done():
		_ = t.Close()
		return nil, ctx.Err()
	}
	return t, nil
}

// newTracker starts a tracker of dbs (validated) with cfg (defaults
// applied, Logger and MeterProvider set), without waiting for its first
// polls.
func newTracker(dbs map[string]Database, cfg *TrackerConfig, opts trackerOptions) (*Tracker, error) {
	dbs = cloneDatabases(dbs)
	log := cfg.Logger
	names := make([]string, 0, len(dbs))
	for name := range dbs {
		names = append(names, name)
	}
	sort.Strings(names)

	t := &Tracker{cfg: cfg, dbs: dbs, log: log, sink: opts.sink, initDone: make(chan struct{}),
		warnImpossible: rate.Sometimes{First: 3, Interval: 10 * time.Second}}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	snap := &Snapshot{Databases: make([]DatabaseState, len(names)), changed: make(chan struct{})}
	var pools []*pgxpool.Pool
	fail := func(err error) (*Tracker, error) {
		t.cancel()
		for _, p := range pools {
			p.Close()
		}
		return nil, err
	}
	for i, name := range names {
		db := dbs[name]
		ds := &snap.Databases[i]
		ds.Name = name
		ds.Replicas = make([]ReplicaState, len(db.Replicas))
		pp, err := trackerPool(db.Primary)
		if err != nil {
			return fail(fmt.Errorf("caughtup/replay: tracker pool for database %q primary: %w", name, err))
		}
		pools = append(pools, pp)
		t.primarys = append(t.primarys, &primaryPoller{db: i, dbName: name, pool: pp, kick: make(chan struct{}, 1), role: pp.Config().ConnConfig.User})
		var rps []*replicaPoller
		for j, r := range db.Replicas {
			ds.Replicas[j].Name = r.Name
			rp, err := trackerPool(r.Pool)
			if err != nil {
				return fail(fmt.Errorf("caughtup/replay: tracker pool for database %q replica %q: %w", name, r.Name, err))
			}
			pools = append(pools, rp)
			p := &replicaPoller{db: i, idx: j, dbName: name, name: r.Name, pool: rp, kick: make(chan struct{}, 1), role: rp.Config().ConnConfig.User}
			rps = append(rps, p)
		}
		t.replicas = append(t.replicas, rps)
	}
	t.snap.Store(snap)
	var err error
	mp := cfg.MeterProvider
	if opts.noMetrics {
		mp = noop.NewMeterProvider()
	}
	if t.met, err = newTrackerMetrics(mp, t); err != nil {
		return fail(fmt.Errorf("caughtup/replay: creating the tracker's instruments: %w", err))
	}

	if cfg.Feed != nil {
		if t.feed, err = newFeedState(t); err != nil {
			t.met.close()
			return fail(err)
		}
	}

	n := len(t.primarys)
	if t.feed == nil {
		// On a feed the replicas are identified on demand: NewTracker
		// does not wait for them.
		for _, rps := range t.replicas {
			n += len(rps)
		}
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
// ApplicationName.
func trackerPool(p *pgxpool.Pool) (*pgxpool.Pool, error) {
	c := p.Config()
	c.MaxConns, c.MinConns, c.MinIdleConns = 1, 0, 0
	if c.ConnConfig.RuntimeParams == nil {
		c.ConnConfig.RuntimeParams = make(map[string]string)
	}
	c.ConnConfig.RuntimeParams["application_name"] = ApplicationName
	return pgxpool.NewWithConfig(context.Background(), c)
}

// Close stops the tracker's goroutines and closes its connections, not
// the application's pools. Snapshots taken later never change again, and
// every replica in them soon counts as stale. Idempotent.
func (t *Tracker) Close() error {
	t.closeOnce.Do(t.close)
	return nil
}

func (t *Tracker) close() {
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
		}
	}
}

// Snapshot returns the tracker's current state. It is shared and
// immutable: do not modify it. On a feed, the first call is what has the
// tracker identify its replicas (see FeedConfig): until then they are
// unknown.
func (t *Tracker) Snapshot() *Snapshot {
	if f := t.feed; f != nil && !f.wanted.Load() {
		f.demand()
	}
	return t.snap.Load()
}

// Config returns the tracker's configuration with defaults applied.
func (t *Tracker) Config() TrackerConfig { return *t.cfg }

// Databases returns the databases the tracker watches: a copy of the map,
// with the application's pools.
func (t *Tracker) Databases() map[string]Database { return cloneDatabases(t.dbs) }

func (t *Tracker) snapshot() *Snapshot { return t.snap.Load() }

func (t *Tracker) initialized() {
	if t.initLeft.Add(-1) == 0 {
		close(t.initDone)
	}
}

// publish replaces the snapshot with one whose database db is ds, then
// wakes everything waiting on the old one. t.mu must be held.
func (t *Tracker) publish(old *Snapshot, db int, ds DatabaseState) {
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
func nextPoll(last time.Time, waiting bool, cfg *TrackerConfig) time.Time {
	if waiting {
		return last.Add(cfg.WaitPollInterval)
	}
	return last.Add(cfg.PollInterval)
}

func (t *Tracker) runReplica(p *replicaPoller) {
	sc := schedule{poll: func() bool { return t.pollReplica(p) }, waiting: func() bool { return p.waiters.Load() > 0 }, kick: p.kick}
	if t.feed != nil {
		sc.node, sc.onDemand = t.feed.replicas[p.db][p.idx], true
	}
	t.run(sc)
}

func (t *Tracker) runPrimary(p *primaryPoller) {
	sc := schedule{poll: func() bool { return t.pollPrimary(p) }, waiting: func() bool { return false }, kick: p.kick}
	if t.feed != nil {
		sc.node = t.feed.primarys[p.db]
	}
	t.run(sc)
}

// schedule is what run polls and when.
type schedule struct {
	// poll polls the node once and reports whether it answered.
	poll func() bool
	// waiting reports callers waiting on the node (WaitPollInterval).
	waiting func() bool
	// kick wakes run to look at the schedule again.
	kick chan struct{}
	// node is the node as the feed knows it; nil without a feed.
	node *feedNode
	// onDemand: the first poll (the node's identification) waits until
	// the tracker is asked about its positions (feedState.demand).
	onDemand bool
}

// run polls on the schedule of nextPoll (measured from the start of each
// poll, so that a slow query does not stretch the period) until the
// tracker stops, and marks the node initialized after its first poll. A
// kick (a first waiter, or the feed lapsing) makes it look at the schedule
// again. On a feed, while the feed covers the node (a time until which it
// does), it does not poll at all, waiters or not: the publishers set the
// pace; and a poll that failed is retried after a jittered backoff that
// grows to FeedConfig.RetryMax, which no kick shortens, so that a fleet
// whose connections a replica refuses (max_connections) does not try
// again ten times a second per process, all together.
func (t *Tracker) run(sc schedule) {
	defer t.wg.Done()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	counted := !sc.onDemand
	if sc.onDemand {
		select {
		case <-t.feed.demanded:
		case <-t.ctx.Done():
			return
		}
	}
	var bo backoff.ExponentialBackOff
	if sc.node != nil {
		bo = retry.Jittered(t.cfg.PollInterval, t.cfg.Feed.RetryMax)
	}
	var retryAt time.Time // zero while the last poll answered
	for {
		start := t.cfg.Now()
		ok := sc.poll()
		if counted {
			counted = false
			t.initialized()
		}
		if sc.node != nil {
			if ok {
				bo.Reset()
				retryAt = time.Time{}
			} else if t.ctx.Err() == nil {
				wait := bo.NextBackOff()
				retryAt = start.Add(wait)
				t.feed.unreachable(sc.node, wait)
			}
		}
		for {
			due := nextPoll(start, sc.waiting(), t.cfg)
			if sc.node != nil {
				if until := t.feed.fedUntil(sc.node); !until.IsZero() {
					due = until
				}
				if due.Before(retryAt) {
					due = retryAt
				}
			}
			d := due.Sub(t.cfg.Now())
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
			case <-sc.kick:
				timer.Stop()
			}
		}
	}
}

// observeReplica polls a replica once.
func (t *Tracker) observeReplica(p *replicaPoller) (ReplicaObservation, bool) {
	o := ReplicaObservation{ObservedAt: t.cfg.Now()}
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.StalenessBound)
	r, err := pgwal.ReadReplica(ctx, p.pool, pgwal.Control|pgwal.Status)
	cancel()
	o.ReadBy = t.cfg.Now()
	t.met.query()
	p.queries.Add(1)
	if t.ctx.Err() != nil {
		return o, false // shutting down: not an observation
	}
	if ge := grantError(p.role, err, err == nil && r.InRecovery && r.ReceiverRunning && r.Timeline == 0); ge != nil {
		t.warnGrant(p.dbName, p.name, ge)
		o.Err = ge
		return o, true
	}
	if err != nil {
		o.Err = err
		return o, true
	}
	o.Incarnation, o.InRecovery, o.own = incarnationOf(r), r.InRecovery, true
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

// pollReplica polls a replica once and reports whether it answered.
func (t *Tracker) pollReplica(p *replicaPoller) bool {
	o, ok := t.observeReplica(p)
	if ok {
		t.applyReplica(p, o)
		if t.sink != nil {
			t.sink.replica(p, o)
		}
	}
	return ok && o.Err == nil
}

// applyReplica merges one observation of a replica and publishes the
// result. The guard's source (the snapshot) is updated in the same step,
// so that HighestReplayed is never behind a position a decision can use.
func (t *Tracker) applyReplica(p *replicaPoller, o ReplicaObservation) {
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
func (t *Tracker) mergeReplicaLocked(db, idx int, o ReplicaObservation) (prev, next ReplicaState, ch replicaChange) {
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
func (t *Tracker) reportReplica(db, idx int, prev, next ReplicaState, ch replicaChange) {
	t.reportMerge(db, idx, prev, next, ch)
	t.reportDiverged(db, prev, next)
}

// reportMerge is reportReplica but for divergence.
func (t *Tracker) reportMerge(db, idx int, prev, next ReplicaState, ch replicaChange) {
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
	if ch.serverChanged {
		t.log.Warn("caughtup: the tracker's connection to the replica now reaches another server (a balanced endpoint, a DNS move, a failover behind a virtual IP); its state replaces the old one, and every handler connection is checked against the server the decision judged",
			attrs(slog.String("replayed", next.Replayed.LSN.String()))...)
	}
	if next.Observations > 0 && !next.InRecovery && (ch.leftRecovery || prev.Observations == 0 || ch.restarted) {
		t.log.Warn("caughtup: node is not in recovery (promoted?); it is no longer used as a replica", attrs()...)
	}
}

func (t *Tracker) reportDiverged(db int, prev, next ReplicaState) {
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
func (t *Tracker) observePrimary(p *primaryPoller) (PrimaryObservation, bool) {
	o := PrimaryObservation{ObservedAt: t.cfg.Now()}
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.StalenessBound)
	defer cancel()
	r, err := pgwal.ReadPrimary(ctx, p.pool, pgwal.Control)
	t.met.query()
	p.queries.Add(1)
	if t.ctx.Err() != nil {
		return o, false
	}
	if ge := grantError(p.role, err, false); ge != nil {
		t.warnGrant(p.dbName, "", ge)
		o.Err = ge
		return o, true
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

// pollPrimary polls a primary once and reports whether it answered.
func (t *Tracker) pollPrimary(p *primaryPoller) bool {
	o, ok := t.observePrimary(p)
	if ok {
		t.applyPrimary(p.db, o, false)
		if t.sink != nil {
			t.sink.primary(p, o)
		}
	}
	return ok && o.Err == nil
}

// applyPrimary merges one observation of a primary (fromFeed: delivered by
// the feed, else the tracker's own poll), re-derives its replicas' states
// (rules 4 and 5), merges the feed's replica observations that waited for
// it, and publishes the result.
func (t *Tracker) applyPrimary(db int, o PrimaryObservation, fromFeed bool) {
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
func (t *Tracker) readHistory(ctx context.Context, p *primaryPoller) {
	h, err := pgwal.ReadHistory(ctx, p.pool, p.histTLI)
	t.met.query()
	if err == nil {
		p.hist, p.histKnown = h, true
		return
	}
	p.histDenied = errors.Is(err, pgwal.ErrHistoryDenied)
	t.log.Warn("caughtup: cannot read the timeline history; tokens from older timelines will read the primary, and a standby left on an older timeline is not recognized as diverged",
		slog.String(attrDatabase, p.dbName), slog.Uint64("timeline", uint64(p.histTLI)), slog.Any("error", err))
}

// NodeStat is what a tracker spends on one node.
type NodeStat struct {
	Database string
	// Replica names the replica; "" for the database's primary.
	Replica string
	// Queries counts the queries the tracker sent the node.
	Queries uint64
	// Watchers counts the callers watching the replica (Watch, waiting
	// jobs, a Guard holding a connection): while there are any, the
	// replica is polled every WaitPollInterval.
	Watchers int
	// Conns is the tracker's open connections to the node: 1 while it
	// polls the node, 0 while a feed covers it.
	Conns int
}

// warnGrant logs, once per node and privilege, what the tracker's role
// lacks and the GRANT that gives it.
func (t *Tracker) warnGrant(database, node string, ge *GrantError) {
	if _, seen := t.granted.LoadOrStore([3]string{database, node, ge.Privilege}, true); seen {
		return
	}
	t.log.Warn("caughtup: the tracker's role lacks a privilege; the node counts as unknown until it is granted (logged once)",
		slog.String(attrDatabase, database), slog.String(attrReplica, node), slog.String("caughtup.role", ge.Role),
		slog.String("caughtup.privilege", ge.Privilege), slog.String("caughtup.grant", ge.Grant), slog.String("caughtup.lost", ge.Lost))
}

// Stat returns what the tracker spends on each node, databases in name
// order, each primary before its replicas.
func (t *Tracker) Stat() []NodeStat {
	var out []NodeStat
	for db, pp := range t.primarys {
		out = append(out, NodeStat{Database: pp.dbName, Queries: pp.queries.Load(), Conns: int(pp.pool.Stat().TotalConns())})
		for _, p := range t.replicas[db] {
			out = append(out, NodeStat{Database: p.dbName, Replica: p.name, Queries: p.queries.Load(),
				Watchers: int(p.waiters.Load()), Conns: int(p.pool.Stat().TotalConns())})
		}
	}
	return out
}

// Watch makes the tracker poll database's replicas every WaitPollInterval
// instead of every PollInterval until stop is called, so that a caller
// waiting on Snapshot.Changed learns within a few milliseconds that a
// replica caught up. It speeds up the replicas whose last query succeeded
// when Watch is called; failing, diverged and promoted ones keep the slow
// pace, so that watching never turns into a reconnect storm. The load is
// shared: however many callers watch, a replica is polled at most once per
// WaitPollInterval. A database the tracker does not know is not watched.
// stop is idempotent.
func (t *Tracker) Watch(database string) (stop func()) {
	s := t.Snapshot() // on a feed, a watch is a demand for the replicas too
	for db := range s.Databases {
		if s.Databases[db].Name != database {
			continue
		}
		var idx []int
		for i := range s.Databases[db].Replicas {
			if s.Databases[db].Replicas[i].Err == nil {
				idx = append(idx, i)
			}
		}
		var once sync.Once
		undo := t.watch(db, idx)
		return func() { once.Do(undo) }
	}
	return func() {}
}

// watch makes the pollers of the given replicas of database db poll every
// WaitPollInterval until the returned function is called. Replicas that
// cannot catch up with any token (diverged, promoted) are not sped up.
func (t *Tracker) watch(db int, replicas []int) func() {
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
