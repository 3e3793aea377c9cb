package consume

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/position"
)

// One round trip per replica: everything a decision needs, read in one
// statement so the values belong together. The time lag is computed on the
// server so client clock skew does not enter it.
const replicaQuery = `SELECT pg_is_in_recovery(),
	pg_last_wal_replay_lsn()::text,
	pg_last_xact_replay_timestamp(),
	extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8,
	(SELECT received_tli FROM pg_stat_wal_receiver),
	(SELECT system_identifier FROM pg_control_system())`

// The primary's timeline comes from the WAL file name of its current
// position (design fact 3): pg_control_checkpoint() lags a promotion until
// the next checkpoint. pg_walfile_name errors during recovery, which is
// what a "primary" that is really a standby deserves.
//
// The WAL page and segment sizes let Decide see that an insert position
// just past a page header is the end of the record before it (see
// recordEnd).
const primaryQuery = `SELECT pg_current_wal_insert_lsn()::text,
	pg_walfile_name(pg_current_wal_lsn()),
	(SELECT system_identifier FROM pg_control_system()),
	c.max_data_alignment::int8, c.wal_block_size::int8, c.bytes_per_wal_segment::int8
	FROM pg_control_init() c`

const historyQuery = `SELECT pg_read_file('pg_wal/' || lpad(to_hex($1::int), 8, '0') || '.history')`

// tracker polls every node with its own one-connection pool, so its
// queries never queue behind handlers on the application's pools, and
// publishes an immutable Snapshot after every observation.
type tracker struct {
	cfg *Config
	log *slog.Logger

	mu   sync.Mutex // serializes publishers; readers use snap
	snap atomic.Pointer[Snapshot]

	replicas [][]*replicaPoller // by database index, then replica index
	primarys []*primaryPoller

	queries queryCounter

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

	// waiters counts jobs waiting on this replica; above zero the poller
	// uses WaitPollInterval. kick wakes it when the first one arrives.
	waiters atomic.Int32
	kick    chan struct{}
}

type primaryPoller struct {
	db     int
	dbName string
	pool   *pgxpool.Pool

	// The history is read once per timeline.
	histTLI    uint32
	hist       position.History
	histKnown  bool
	histDenied bool
}

func newTracker(cfg *Config, log *slog.Logger, queries queryCounter) (*tracker, error) {
	names := make([]string, 0, len(cfg.Databases))
	for name := range cfg.Databases {
		names = append(names, name)
	}
	sort.Strings(names)

	t := &tracker{cfg: cfg, log: log, queries: queries, initDone: make(chan struct{})}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	snap := &Snapshot{Databases: make([]DatabaseState, len(names)), changed: make(chan struct{})}
	var pools []*pgxpool.Pool
	fail := func(err error) (*tracker, error) {
		t.cancel()
		for _, p := range pools {
			p.Close()
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
		t.primarys = append(t.primarys, &primaryPoller{db: i, dbName: name, pool: pp})
		var rps []*replicaPoller
		for j, r := range db.Replicas {
			ds.Replicas[j].Name = r.Name
			rp, err := trackerPool(r.Pool)
			if err != nil {
				return fail(fmt.Errorf("caughtup/consume: tracker pool for database %q replica %q: %w", name, r.Name, err))
			}
			pools = append(pools, rp)
			rps = append(rps, &replicaPoller{db: i, idx: j, dbName: name, name: r.Name, pool: rp, kick: make(chan struct{}, 1)})
		}
		t.replicas = append(t.replicas, rps)
	}
	t.snap.Store(snap)

	n := len(t.primarys)
	for _, rps := range t.replicas {
		n += len(rps)
	}
	t.initLeft.Store(int32(n))
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
	return t, nil
}

// trackerPool copies the application's pool config (hooks included, so
// credentials rotate the same way) into a pool of one connection.
func trackerPool(p *pgxpool.Pool) (*pgxpool.Pool, error) {
	c := p.Config()
	c.MaxConns, c.MinConns, c.MinIdleConns = 1, 0, 0
	return pgxpool.NewWithConfig(context.Background(), c)
}

func (t *tracker) close() {
	t.cancel()
	t.wg.Wait()
	for _, p := range t.primarys {
		p.pool.Close()
	}
	for _, rps := range t.replicas {
		for _, p := range rps {
			p.pool.Close()
		}
	}
}

func (t *tracker) snapshot() *Snapshot { return t.snap.Load() }

func (t *tracker) initialized() {
	if t.initLeft.Add(-1) == 0 {
		close(t.initDone)
	}
}

// update publishes a copy of the snapshot with database db changed by fn,
// then wakes everything waiting on the old one.
func (t *tracker) update(db int, fn func(ds *DatabaseState)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.snap.Load()
	ns := &Snapshot{Seq: old.Seq + 1, Databases: slices.Clone(old.Databases), changed: make(chan struct{})}
	ds := &ns.Databases[db]
	ds.Replicas = slices.Clone(ds.Replicas)
	fn(ds)
	t.snap.Store(ns)
	close(old.changed)
}

// sleep waits until next, returning early when kicked (if kick is not
// nil); false when the tracker stops.
func (t *tracker) sleep(timer *time.Timer, d time.Duration, kick chan struct{}) bool {
	if d <= 0 {
		select {
		case <-t.ctx.Done():
			return false
		default:
			return true
		}
	}
	timer.Reset(d)
	select {
	case <-t.ctx.Done():
		return false
	case <-timer.C:
	case <-kick:
		timer.Stop()
	}
	return true
}

func (t *tracker) runReplica(p *replicaPoller) {
	t.run(func() { t.pollReplica(p) }, func() time.Duration {
		if p.waiters.Load() > 0 {
			return t.cfg.WaitPollInterval
		}
		return t.cfg.PollInterval
	}, p.kick)
}

func (t *tracker) runPrimary(p *primaryPoller) {
	t.run(func() { t.pollPrimary(p) }, func() time.Duration { return t.cfg.PollInterval }, nil)
}

// run polls once per interval (measured from the start of each poll, so
// a slow query does not stretch the period) until the tracker stops, and
// marks the node initialized after its first poll. kick cuts a sleep
// short.
func (t *tracker) run(poll func(), interval func() time.Duration, kick chan struct{}) {
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
		if !t.sleep(timer, interval()-time.Since(start), kick) {
			return
		}
	}
}

func (t *tracker) pollReplica(p *replicaPoller) {
	var (
		inRecovery bool
		lsnText    *string
		replayTS   *time.Time
		lagSeconds *float64
		tli        *int32
		sysID      *int64
	)
	sent := t.cfg.Now()
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.StalenessBound)
	err := p.pool.QueryRow(ctx, replicaQuery).Scan(&inRecovery, &lsnText, &replayTS, &lagSeconds, &tli, &sysID)
	cancel()
	t.queries.Add(1)
	if t.ctx.Err() != nil {
		return // shutting down: not an observation
	}
	var lsn position.LSN
	if err == nil && lsnText != nil {
		lsn, err = position.ParseLSN(*lsnText)
	}
	var prev ReplicaState
	t.update(p.db, func(ds *DatabaseState) {
		r := &ds.Replicas[p.idx]
		prev = *r
		if err != nil {
			// Keep the last values for display; Err makes them unusable.
			r.Err = err
			return
		}
		r.Err = nil
		r.ObservedAt = sent
		r.Observations++
		r.InRecovery = inRecovery
		r.Replayed = position.Replayed{LSN: lsn}
		// Without a running WAL receiver the timeline the replay belongs
		// to is not known for sure (the checkpoint's timeline lags a
		// promotion), so the epoch stays unknown and the replica is never
		// caught up until the receiver is back.
		if tli != nil && sysID != nil && *tli > 0 {
			r.Replayed.Epoch = position.Epoch{SystemID: uint64(*sysID), Timeline: uint32(*tli)}
		}
		r.ReplayTimestamp = time.Time{}
		if replayTS != nil {
			r.ReplayTimestamp = *replayTS
		}
		r.TimeLag = 0
		if lagSeconds != nil && *lagSeconds > 0 {
			r.TimeLag = time.Duration(*lagSeconds * float64(time.Second))
		}
		r.LagBytes, r.LagKnown = 0, false
		if pe := ds.Primary.Epoch; !pe.IsZero() && pe == r.Replayed.Epoch && lsn != 0 {
			r.LagBytes, r.LagKnown = lsn.BytesBefore(ds.Primary.InsertLSN), true
		}
		r.Healthy = !r.LagKnown ||
			(r.LagBytes <= t.cfg.MaxLagBytes && (r.LagBytes == 0 || r.TimeLag <= t.cfg.MaxLagTime))
	})
	t.logReplicaChange(p, prev, err, inRecovery)
}

func (t *tracker) logReplicaChange(p *replicaPoller, prev ReplicaState, err error, inRecovery bool) {
	attrs := func(extra ...any) []any {
		return append([]any{slog.String(attrDatabase, p.dbName), slog.String(attrReplica, p.name)}, extra...)
	}
	switch {
	case err != nil && prev.Err == nil:
		t.log.Warn("caughtup: replica unreadable; not used until it answers", attrs(slog.Any("error", err))...)
	case err == nil && prev.Err != nil:
		t.log.Info("caughtup: replica readable again", attrs()...)
	}
	if err == nil && !inRecovery && (prev.InRecovery || prev.Observations == 0) {
		t.log.Warn("caughtup: node is not in recovery (promoted?); it is no longer used as a replica", attrs()...)
	}
}

func (t *tracker) pollPrimary(p *primaryPoller) {
	var (
		lsnText         string
		walfile         string
		sysID           int64
		align, blk, seg int64
		tli             uint64
		insertAt        position.LSN
	)
	sent := t.cfg.Now()
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.StalenessBound)
	defer cancel()
	err := p.pool.QueryRow(ctx, primaryQuery).Scan(&lsnText, &walfile, &sysID, &align, &blk, &seg)
	t.queries.Add(1)
	if t.ctx.Err() != nil {
		return
	}
	if err == nil {
		insertAt, err = position.ParseLSN(lsnText)
	}
	if err == nil {
		if len(walfile) < 8 {
			err = fmt.Errorf("caughtup/consume: unexpected WAL file name %q", walfile)
		} else if tli, err = strconv.ParseUint(walfile[:8], 16, 32); err == nil && tli == 0 {
			err = fmt.Errorf("caughtup/consume: timeline 0 in WAL file name %q", walfile)
		}
	}
	if err == nil && uint32(tli) != p.histTLI {
		p.histTLI, p.hist, p.histKnown, p.histDenied = uint32(tli), nil, tli == 1, false
	}
	if err == nil && !p.histKnown && !p.histDenied {
		t.readHistory(ctx, p)
	}
	epoch := position.Epoch{SystemID: uint64(sysID), Timeline: uint32(tli)}
	var prev PrimaryState
	t.update(p.db, func(ds *DatabaseState) {
		prev = ds.Primary
		if err != nil {
			ds.Primary.Err = err
			return
		}
		ds.Primary = PrimaryState{
			Epoch: epoch, History: p.hist, HistoryKnown: p.histKnown,
			InsertLSN: insertAt, ObservedAt: sent,
			WAL: position.WALLayout{MaxAlign: uint64(max(align, 0)), BlockSize: uint64(max(blk, 0)), SegmentSize: uint64(max(seg, 0))},
		}
	})
	switch {
	case err != nil && prev.Err == nil:
		t.log.Warn("caughtup: primary unreadable; its epoch is unknown and replica lag unmeasured",
			slog.String(attrDatabase, p.dbName), slog.Any("error", err))
	case err == nil && !prev.Epoch.IsZero() && prev.Epoch != epoch:
		t.log.Warn("caughtup: primary epoch changed",
			slog.String(attrDatabase, p.dbName), slog.String("from", prev.Epoch.String()), slog.String("to", epoch.String()),
			slog.Bool("history_known", p.histKnown))
	case err == nil && prev.Err != nil:
		t.log.Info("caughtup: primary readable again", slog.String(attrDatabase, p.dbName))
	}
}

// readHistory reads the timeline history file. Without it, tokens from
// older timelines cannot be placed and read the primary; with no right to
// read it (SQLSTATE 42501) it is not asked for again on this timeline.
func (t *tracker) readHistory(ctx context.Context, p *primaryPoller) {
	var text string
	err := p.pool.QueryRow(ctx, historyQuery, int32(p.histTLI)).Scan(&text)
	t.queries.Add(1)
	if err == nil {
		var h position.History
		if h, err = position.ParseHistory(text); err == nil {
			p.hist, p.histKnown = h, true
			return
		}
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		p.histDenied = true
	}
	t.log.Warn("caughtup: cannot read the timeline history; tokens from older timelines will read the primary",
		slog.String(attrDatabase, p.dbName), slog.Uint64("timeline", uint64(p.histTLI)), slog.Any("error", err))
}

// watch makes the pollers of the given replicas poll fast until the
// returned function is called.
func (t *tracker) watch(db int, replicas []int) func() {
	var ps []*replicaPoller
	for _, i := range replicas {
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
