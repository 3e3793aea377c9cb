package replay

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/time/rate"
)

// FeedConfig makes a tracker take replica and primary positions from a
// position feed that a few Publishers fill, instead of querying every node
// itself. What a router on the feed believes, and why that never reads
// stale, is in docs/design.md ("What a router on the feed believes");
// costs and sizing in docs/fleet.md.
type FeedConfig struct {
	// Source is the feed: on Redis, a feed.Subscriber (feed.NewSubscriber
	// with the publishers' Redis, feed name and keys; see docs/feed.md).
	// Required. The tracker subscribes to it once and never closes
	// anything of it.
	Source FeedSource

	// SilenceBound: a node of which no feed observation has been merged
	// for this long is polled by the router itself until the feed covers
	// it again, and a feed with no authentic message for this long counts
	// as silent (every node is polled locally). It must not be negative,
	// and must be below TrackerConfig.StalenessBound; raise it (with
	// StalenessBound) only for publishers that poll slower than the
	// default.
	// Default: half of TrackerConfig.StalenessBound (500ms).
	// Local polling has taken over before what the feed said goes stale.
	SilenceBound time.Duration

	// MaxDelay: a message received more than MaxDelay after its publisher
	// sent it (the publisher's clock against the router's, less the time
	// the feed measured it stored) is refused, counted and logged, and the
	// router polls by itself: an old message replayed, or a publisher
	// stalled between polling and sending. The publisher's clock is used
	// only to refuse, never to make an observation look fresher, so a
	// publisher clock more than MaxDelay behind the router's costs
	// availability, never freshness: keep clocks synchronized. Negative
	// disables the check.
	// Default: DefaultFeedMaxDelay (5s).
	// Far above what NTP-synchronized clocks differ by (milliseconds).
	MaxDelay time.Duration

	// RetryMax bounds the wait between two attempts to reach a node that
	// did not answer the router's own query (its identification, a poll
	// while the feed does not cover it, the check of a restart): the
	// first retry comes a PollInterval later, each next one twice as
	// late, ±50% at random, up to RetryMax. Meanwhile the node is not
	// polled, and kicks do not hurry it: a replica not yet identified
	// stays unknown, one identified before keeps taking the feed's
	// observations. Must not be negative.
	// Default: DefaultFeedRetryMax (5s).
	// A fleet restarted at once against a replica that refuses its
	// connections (max_connections) spreads its retries over seconds
	// instead of trying ten times a second per process, together; a
	// replica that answers again is identified within seconds.
	RetryMax time.Duration
}

// DefaultFeedMaxDelay is FeedConfig.MaxDelay's default.
const DefaultFeedMaxDelay = 5 * time.Second

// DefaultFeedRetryMax is FeedConfig.RetryMax's default.
const DefaultFeedRetryMax = 5 * time.Second

func (c FeedConfig) withDefaults(staleness time.Duration) FeedConfig {
	if c.SilenceBound == 0 {
		c.SilenceBound = staleness / 2
	}
	if c.MaxDelay == 0 {
		c.MaxDelay = DefaultFeedMaxDelay
	}
	if c.RetryMax == 0 {
		c.RetryMax = DefaultFeedRetryMax
	}
	return c
}

func (c FeedConfig) validate(staleness time.Duration) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: Feed: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	switch {
	case c.Source == nil:
		return bad("Source is required (on Redis, a feed.Subscriber: feed.NewSubscriber with the publishers' Redis, feed name and keys)")
	case c.SilenceBound <= 0 || c.SilenceBound >= staleness:
		return bad("SilenceBound %v must be positive and below StalenessBound %v, so that the router polls by itself before what the feed said goes stale", c.SilenceBound, staleness)
	case c.RetryMax < 0:
		return bad("RetryMax %v must not be negative", c.RetryMax)
	}
	return nil
}

// ErrUnconfirmedRestart is the Err of a replica whose feed observation
// shows a newer run of the server (a restart) than the router's own poll
// has seen: the replica counts as unknown until the router's own poll,
// made at once, confirms the run (the publisher's node is the router's)
// or contradicts it (the names disagree; the feed's observations of that
// run are then ignored and the router polls the replica itself).
var ErrUnconfirmedRestart = errors.New("caughtup/replay: the feed shows the replica restarted; unknown until this router's own poll confirms it")

// FeedPollError is the Err of a node whose newest observation is a
// publisher's failed poll.
type FeedPollError struct {
	// Publisher names the publisher (name#instance).
	Publisher string
	// Text is the poll's error as the publisher sent it.
	Text string
}

func (e *FeedPollError) Error() string {
	return "caughtup/replay: feed publisher " + e.Publisher + " could not poll the node: " + e.Text
}

// FeedStatus is a Router's use of its feed.
type FeedStatus struct {
	// Configured: Config.Feed is set.
	Configured bool
	// Active: the subscription is healthy (FeedSubscribed), so the nodes
	// the feed covers are not polled by the router.
	Active bool
	// Health is the subscription's state and since when.
	Health FeedHealth
	// LocalNodes counts the identified nodes the router polls itself:
	// every one while the feed is not Active, else those the feed does not
	// cover (no observation merged within FeedConfig.SilenceBound).
	LocalNodes int
	// Unidentified counts the nodes whose server run the router has not
	// read itself yet (a replica no one asked about since the router
	// started, or one its identification could not reach: retried with
	// backoff, FeedConfig.RetryMax). The feed's observations of them are
	// not believed, and they are not polled on schedule: they are unknown.
	Unidentified int
	// Fallbacks counts, since the Router started, the times it went back
	// to polling by itself: all nodes (the feed stopped being usable; see
	// also caughtup.consume.feed.switches) or one node (the feed stopped
	// covering it while usable).
	Fallbacks uint64
}

// Feed reports how the tracker uses its feed; the zero FeedStatus when
// TrackerConfig.Feed is not set.
func (t *Tracker) Feed() FeedStatus {
	if t.feed == nil {
		return FeedStatus{}
	}
	return t.feed.status()
}

// feedReject numbers why the router refused a feed observation that its
// FeedSource delivered (authentic and unsuperseded).
type feedReject uint8

const (
	// feedRejectDelayed: received more than MaxDelay after it was sent.
	feedRejectDelayed feedReject = iota
	// feedRejectUnknownNode: a database or replica this router does not
	// have (another application's, or a name the publishers spell
	// differently).
	feedRejectUnknownNode
	// feedRejectUnconfirmed: a node the router's own poll has not read
	// yet, or a newer run of it that the router's poll has not confirmed.
	feedRejectUnconfirmed
	// feedRejectMismatch: another system, or a run of the node that the
	// router's own poll contradicted: publisher and router do not mean the
	// same server by the name.
	feedRejectMismatch
	// feedRejectNoIncarnation: a replica observation without its run, in
	// which a restart could not be seen.
	feedRejectNoIncarnation
	// feedRejectSuperseded: an older run than the router's own poll saw:
	// from before a restart (a late or replayed message), or of another
	// server.
	feedRejectSuperseded
	// feedRejectUnverified: a replica position ahead of the primary's
	// known insert position that no primary observation confirmed or
	// refuted within StalenessBound (or while more arrived).
	feedRejectUnverified
	numFeedRejects
)

var feedRejectNames = [numFeedRejects]string{"delayed", "unknown_node", "unconfirmed", "mismatch", "no_incarnation", "superseded", "unverified"}

func (r feedReject) String() string { return feedRejectNames[r] }

// maxPending bounds the feed observations of one replica that wait for a
// primary observation.
const maxPending = 8

// feedState is a Router's feed: the subscriber, whether it is used, and
// per node whether the feed covers it and who the node is.
type feedState struct {
	t       *Tracker
	cfg     FeedConfig
	log     *slog.Logger
	src     FeedSource
	met     *feedMetrics
	channel string

	healthMu sync.Mutex
	health   FeedHealth

	dbIndex      map[string]int
	replicaIndex []map[string]int
	replicas     [][]*feedNode
	primarys     []*feedNode
	nodes        []*feedNode

	active    atomic.Bool
	fallbacks atomic.Uint64

	// systems holds each database's system identifier from the router's
	// own polls. t.mu.
	systems []uint64

	// wanted is set, and demanded closed, when the tracker is first asked
	// about its positions: the replicas' pollers identify them then.
	wanted   atomic.Bool
	demanded chan struct{}

	warn      [numFeedRejects]rate.Sometimes
	warnLocal rate.Sometimes
	warnRetry rate.Sometimes
}

// feedNode is one node as the feed and the router's own polls know it.
type feedNode struct {
	db, idx int // idx -1: the primary
	name    string
	kick    chan struct{}
	pool    *pgxpool.Pool

	// fedAt is when (time.Now, UnixNano) a feed observation of the node
	// was last merged.
	fedAt atomic.Int64
	// confirmWanted: a feed observation shows a run the router's own poll
	// has not seen; poll now.
	confirmWanted atomic.Bool
	// local: the poller polls the node itself (for the gauge and logs).
	local atomic.Bool
	// identified: confirmedKnown, readable without t.mu.
	identified atomic.Bool

	// Guarded by tracker.mu.
	confirmed      Incarnation // the run the router's own poll last saw
	confirmedKnown bool        // a poll of the router's succeeded
	claim          Incarnation // a newer run the feed showed, awaiting a poll
	claimAt        time.Time
	mismatch       Incarnation // a run of the feed's that the router's poll contradicted
	pending        []ReplicaObservation
}

func (n *feedNode) label() string {
	if n.idx < 0 {
		return "primary"
	}
	return n.name
}

func newFeedState(t *Tracker) (*feedState, error) {
	cfg := *t.cfg.Feed
	f := &feedState{
		t:         t,
		cfg:       cfg,
		log:       t.log.With(slog.String("feed", cfg.Source.Destination())),
		src:       cfg.Source,
		channel:   cfg.Source.Destination(),
		health:    FeedHealth{State: FeedConnecting, Since: t.cfg.Now()},
		dbIndex:   make(map[string]int),
		systems:   make([]uint64, len(t.primarys)),
		warnLocal: rate.Sometimes{First: 5, Interval: 10 * time.Second},
		warnRetry: rate.Sometimes{First: 3, Interval: 10 * time.Second},
		demanded:  make(chan struct{}),
	}
	for i := range f.warn {
		f.warn[i] = rate.Sometimes{First: 3, Interval: 10 * time.Second}
	}
	for db, pp := range t.primarys {
		f.dbIndex[pp.dbName] = db
		n := &feedNode{db: db, idx: -1, kick: pp.kick, pool: pp.pool}
		f.primarys = append(f.primarys, n)
		f.nodes = append(f.nodes, n)
		idx := make(map[string]int)
		var ns []*feedNode
		for j, rp := range t.replicas[db] {
			idx[rp.name] = j
			n := &feedNode{db: db, idx: j, name: rp.name, kick: rp.kick, pool: rp.pool}
			ns = append(ns, n)
			f.nodes = append(f.nodes, n)
		}
		f.replicaIndex = append(f.replicaIndex, idx)
		f.replicas = append(f.replicas, ns)
	}
	mp := t.cfg.MeterProvider
	var err error
	if f.met, err = newFeedMetrics(mp, f); err != nil {
		return nil, fmt.Errorf("caughtup/replay: creating the feed's instruments: %w", err)
	}
	f.log.Info("caughtup: the router takes positions from the feed; it identifies each node itself first (a replica when first asked about it)",
		slog.Duration("silence_bound", cfg.SilenceBound), slog.Duration("max_delay", cfg.MaxDelay))
	return f, nil
}

// start subscribes once the router's own first polls of the primaries
// are in (or StalenessBound has passed), so that the stored values read
// on subscribing find them identified. The feed's observations of a node
// are believed only after the router has seen which run of which system
// the node is, so that a message from before a restart is superseded, not
// believed; the replicas are identified when first asked about (demand),
// and their observations believed from the next message on.
func (f *feedState) start() {
	t := f.t
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		bound := time.NewTimer(t.cfg.StalenessBound)
		defer bound.Stop()
		select {
		case <-t.initDone:
		case <-bound.C:
		case <-t.ctx.Done():
			return
		}
		_ = f.src.Subscribe(t.ctx, FeedHandler{OnObservation: f.deliver, OnHealth: f.onHealth, SilenceBound: f.cfg.SilenceBound})
	}()
}

func (f *feedState) close() { f.met.close() }

func (f *feedState) status() FeedStatus {
	f.healthMu.Lock()
	h := f.health
	f.healthMu.Unlock()
	s := FeedStatus{Configured: true, Active: f.active.Load(), Health: h, Fallbacks: f.fallbacks.Load()}
	for _, n := range f.nodes {
		switch {
		case !n.identified.Load():
			s.Unidentified++
		case n.local.Load():
			s.LocalNodes++
		}
	}
	return s
}

// demand starts the identification of the replicas: the tracker was asked
// about its positions (a job is being routed, or waits). Called on every
// Snapshot until it has been.
func (f *feedState) demand() {
	if f.wanted.CompareAndSwap(false, true) {
		close(f.demanded)
	}
}

// unreachable logs (rate-limited) that the router's own query of n failed
// and when it tries again; the node stays on the feed meanwhile. Called by
// the node's poller only.
func (f *feedState) unreachable(n *feedNode, wait time.Duration) {
	f.warnRetry.Do(func() {
		msg := "caughtup: the router's own query of a node it has identified failed; it keeps the feed's observations of the node and tries again later"
		if !n.identified.Load() {
			msg = "caughtup: the router cannot reach the node to identify its server run; the node is unknown (the feed's observations of it are not believed) until it can, and it tries again later"
		}
		f.log.Warn(msg+" (logged at most every 10s)", slog.String(attrDatabase, f.t.primarys[n.db].dbName),
			slog.String("node", n.label()), slog.Duration("retry_in", wait.Round(time.Millisecond)), slog.Duration("retry_max", f.cfg.RetryMax))
	})
}

// onHealth switches between the feed and local polling: the feed is used
// only while the subscription is healthy.
func (f *feedState) onHealth(h FeedHealth) {
	f.healthMu.Lock()
	f.health = h
	f.healthMu.Unlock()
	if h.State == FeedStopped {
		return // the Router is closing
	}
	on := h.State == FeedSubscribed
	if f.active.Swap(on) == on {
		return
	}
	f.met.switched(on, h.State)
	if on {
		f.log.Info("caughtup: the router takes positions from the feed; it stops polling the nodes the feed covers")
		return
	}
	f.fallbacks.Add(1)
	attrs := []any{slog.String("state", h.State.String())}
	if h.Err != nil {
		attrs = append(attrs, slog.Any("error", h.Err))
	}
	f.log.Warn("caughtup: the feed is not usable; the router polls every node itself until it recovers", attrs...)
	for _, n := range f.nodes {
		kick(n.kick)
	}
}

func kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// fedUntil is the tracker's question: until when does the feed cover n
// (the zero time: poll it now, and on the usual schedule). Called by the
// node's poller only.
func (f *feedState) fedUntil(n *feedNode) time.Time {
	if !n.identified.Load() {
		return time.Time{} // neither fed nor local: its identification is due
	}
	var until time.Time
	if f.active.Load() && !n.confirmWanted.Load() {
		if at := n.fedAt.Load(); at != 0 {
			if u := time.Unix(0, at).Add(f.cfg.SilenceBound); f.t.cfg.Now().Before(u) {
				until = u
			}
		}
	}
	local := until.IsZero()
	if n.local.Swap(local) == local {
		return until
	}
	db := f.t.primarys[n.db].dbName
	if !local {
		// The poller's connection stays closed while the feed covers the
		// node; a fallback opens a new one.
		if n.pool != nil {
			n.pool.Reset()
		}
		f.log.Debug("caughtup: node covered by the feed; the router stops polling it",
			slog.String(attrDatabase, db), slog.String("node", n.label()))
		return until
	}
	if f.active.Load() && n.fedAt.Load() != 0 {
		// The feed had covered the node and lapsed; a node just
		// identified, polled until its first feed message, fell from
		// nothing.
		f.fallbacks.Add(1)
		f.warnLocal.Do(func() {
			f.log.Warn("caughtup: no feed observation of the node merged within the silence bound; the router polls it itself (do the publishers poll it, under the same name?)",
				slog.String(attrDatabase, db), slog.String("node", n.label()), slog.Duration("silence_bound", f.cfg.SilenceBound))
		})
	}
	return until
}

// identified marks n identified by the router's own poll. The first time,
// the node counts as covered by the feed for a SilenceBound, as if a feed
// observation had just been merged: the feed's messages of it were not
// believed until now, and its next one (within a heartbeat) will be. So
// the identifying connection is closed at once rather than polled on
// until that message, and a fleet identifying its replicas together holds
// one connection per process for one query, not for a heartbeat. The
// own poll's state is fresh for StalenessBound, beyond SilenceBound: if
// the feed does not cover the node by then, the router polls it before
// that state goes stale. t.mu is held.
func (f *feedState) identified(n *feedNode) {
	if n.identified.Load() {
		return
	}
	n.fedAt.Store(f.t.cfg.Now().UnixNano())
	// It was polled, on a connection that fedUntil closes when it finds
	// the node covered.
	n.local.Store(true)
	n.identified.Store(true)
}

// polledReplica learns from the router's own poll which run the replica
// is, and settles a run the feed claimed. t.mu is held.
func (f *feedState) polledReplica(db, idx int, o *ReplicaObservation) {
	if o.Err != nil || o.Incarnation.IsZero() {
		return
	}
	n := f.replicas[db][idx]
	n.confirmed, n.confirmedKnown = o.Incarnation, true
	f.identified(n)
	if sys := o.Replayed.Epoch.SystemID; sys != 0 && f.systems[db] == 0 {
		f.systems[db] = sys
	}
	if !n.claim.IsZero() {
		switch {
		case o.Incarnation.Compare(n.claim) >= 0:
			// Confirmed (or overtaken): the feed's node is this one.
		case !o.ObservedAt.Before(n.claimAt):
			// Polled after the feed showed the newer run, and it is not
			// there: the feed's node of that name is another server.
			n.mismatch = n.claim
			f.met.reject(feedRejectMismatch)
			f.warn[feedRejectMismatch].Do(func() {
				f.log.Warn("caughtup: the feed reports a run of the replica that the router's own poll does not see: the publishers mean another server by this name; their observations of it are ignored and the router polls it itself",
					slog.String(attrDatabase, f.t.primarys[db].dbName), slog.String(attrReplica, n.name),
					slog.Time("feed_postmaster_start", n.claim.PostmasterStart), slog.Time("postmaster_start", o.Incarnation.PostmasterStart))
			})
		default:
			return // sent before the claim arrived: poll again
		}
		n.claim, n.claimAt = Incarnation{}, time.Time{}
	}
	n.confirmWanted.Store(false)
}

// polledPrimary learns the database's system from the router's own poll
// of the primary. t.mu is held.
func (f *feedState) polledPrimary(db int, o *PrimaryObservation) {
	if o.Err != nil || o.Epoch.IsZero() {
		return
	}
	f.primarys[db].confirmedKnown = true
	f.identified(f.primarys[db])
	f.systems[db] = o.Epoch.SystemID
}

// deliver is the subscription's callback: one authentic observation,
// stamped with this router's clock.
func (f *feedState) deliver(d FeedDelivery) {
	if f.cfg.MaxDelay >= 0 && !d.SentAt.IsZero() {
		if late := d.ReceivedAt.Sub(d.SentAt) - (d.Age - d.Held); late > f.cfg.MaxDelay {
			f.reject(feedRejectDelayed, &d, fmt.Errorf("received %v after it was sent (the publisher's clock), besides %v stored; MaxDelay is %v",
				late.Round(time.Millisecond), (d.Age-d.Held).Round(time.Millisecond), f.cfg.MaxDelay))
			return
		}
	}
	db, ok := f.dbIndex[d.Database]
	if !ok {
		f.reject(feedRejectUnknownNode, &d, nil)
		return
	}
	// PolledAt on this router's clock: the receipt less the age the feed
	// measured (never the publisher's clock).
	at := f.t.cfg.Now().Add(-d.Age)
	switch d.Role {
	case FeedRolePrimary:
		f.deliverPrimary(db, &d, at)
	case FeedRoleReplica:
		idx, ok := f.replicaIndex[db][d.Node]
		if !ok {
			f.reject(feedRejectUnknownNode, &d, nil)
			return
		}
		f.deliverReplica(db, idx, &d, at)
	}
}

func (f *feedState) deliverPrimary(db int, d *FeedDelivery, at time.Time) {
	o := PrimaryObservation{ObservedAt: at}
	if d.Err != "" {
		o.Err = &FeedPollError{Publisher: d.Publisher.String(), Text: d.Err}
	} else {
		p := &d.Primary
		o.Epoch, o.InsertLSN, o.WAL = p.Epoch, p.InsertLSN, p.WAL
		o.History, o.HistoryKnown = p.History, p.HistoryKnown
	}
	n := f.primarys[db]
	t := f.t
	t.mu.Lock()
	reason := numFeedRejects
	switch {
	case !n.confirmedKnown:
		reason = feedRejectUnconfirmed
	case o.Err == nil && o.Epoch.SystemID != f.systems[db]:
		reason = feedRejectMismatch
	}
	t.mu.Unlock()
	if reason != numFeedRejects {
		f.reject(reason, d, nil)
		return
	}
	t.applyPrimary(db, o, true)
	if o.Err == nil {
		n.fedAt.Store(f.t.cfg.Now().UnixNano())
	}
}

func (f *feedState) deliverReplica(db, idx int, d *FeedDelivery, at time.Time) {
	o := ReplicaObservation{ObservedAt: at, ReadBy: at}
	if d.Err != "" {
		o.Err = &FeedPollError{Publisher: d.Publisher.String(), Text: d.Err}
	} else {
		r := &d.Replica
		o.Incarnation = Incarnation{PostmasterStart: r.Incarnation, RecoveryStart: r.RecoveryStart}
		o.InRecovery = r.InRecovery
		if r.InRecovery {
			o.Replayed.LSN = r.Replayed
			if r.Epoch.SystemID != 0 && r.Epoch.Timeline != 0 {
				o.Replayed.Epoch = r.Epoch
			}
		}
		o.ReplayTimestamp, o.TimeLag = r.ReplayTimestamp, r.TimeLag
	}
	n := f.replicas[db][idx]
	t := f.t
	t.mu.Lock()
	reason, claim := f.checkReplica(n, db, &o, d)
	switch {
	case claim:
		// A newer run than the router has seen: the replica may show
		// less than it did (a restart), or the feed's node is another
		// server. Unknown until the router's own poll, made now, says.
		prev, next, ch := t.mergeReplicaLocked(db, idx, ReplicaObservation{ObservedAt: at, Err: ErrUnconfirmedRestart})
		t.mu.Unlock()
		t.reportReplica(db, idx, prev, next, ch)
		kick(n.kick)
		f.reject(feedRejectUnconfirmed, d, nil)
		return
	case reason != numFeedRejects:
		t.mu.Unlock()
		f.reject(reason, d, nil)
		return
	case held(&o, &t.snap.Load().Databases[db].Primary):
		// Ahead of what the primary is known to have inserted: wait for a
		// primary observation to show it possible, or impossible.
		if len(n.pending) == maxPending {
			n.pending = append(n.pending[:0], n.pending[1:]...)
			f.met.reject(feedRejectUnverified)
		}
		n.pending = append(n.pending, o)
		t.mu.Unlock()
		return
	}
	prev, next, ch := t.mergeReplicaLocked(db, idx, o)
	t.mu.Unlock()
	t.reportReplica(db, idx, prev, next, ch)
	if o.Err == nil && !ch.impossible && !ch.superseded {
		n.fedAt.Store(f.t.cfg.Now().UnixNano())
	}
}

// checkReplica says whether a feed observation of a replica may be merged:
// numFeedRejects if so, a reason if not, or claim when it shows a newer
// run than the router's own poll has seen (which it then asks for). t.mu
// is held.
func (f *feedState) checkReplica(n *feedNode, db int, o *ReplicaObservation, d *FeedDelivery) (reason feedReject, claim bool) {
	switch {
	case !n.confirmedKnown:
		return feedRejectUnconfirmed, false
	case o.Err != nil:
		return numFeedRejects, false
	case o.Incarnation.IsZero():
		return feedRejectNoIncarnation, false
	case d.Replica.Epoch.SystemID != 0 && f.systems[db] != 0 && d.Replica.Epoch.SystemID != f.systems[db]:
		return feedRejectMismatch, false
	}
	switch c := o.Incarnation.Compare(n.confirmed); {
	case c < 0:
		return feedRejectSuperseded, false
	case c > 0:
		if !n.mismatch.IsZero() && o.Incarnation.Compare(n.mismatch) == 0 {
			return feedRejectMismatch, false
		}
		if n.claim.IsZero() || o.Incarnation.Compare(n.claim) != 0 {
			n.claim, n.claimAt = o.Incarnation, f.t.cfg.Now()
		}
		n.confirmWanted.Store(true)
		return numFeedRejects, true
	}
	return numFeedRejects, false
}

// held reports a feed replica observation that must wait for a primary
// observation: a position of the primary's epoch past the primary's known
// insert position (it may be true, the primary having moved on since it
// was observed, or impossible), or any position while the primary is
// unknown. A publisher's word alone never raises a replica past what the
// primary is known to hold.
func held(o *ReplicaObservation, p *PrimaryState) bool {
	if o.Err != nil || !o.InRecovery || o.Replayed.Epoch.IsZero() {
		return false
	}
	return p.Epoch.IsZero() || (o.Replayed.Epoch == p.Epoch && o.Replayed.LSN > p.InsertLSN)
}

// pendingMerge is a waiting feed observation merged by mergePending.
type pendingMerge struct {
	idx        int
	prev, next ReplicaState
	ch         replicaChange
}

// mergePending merges into ds the feed replica observations that waited
// for the primary: those its new insert position shows possible, and those
// it shows impossible, being observed after them (rule 4 then makes the
// replica unknown). Called from applyPrimary with t.mu held and ds
// private.
func (f *feedState) mergePending(db int, ds *DatabaseState) []pendingMerge {
	var out []pendingMerge
	p := &ds.Primary
	cutoff := f.t.cfg.Now().Add(-f.t.cfg.StalenessBound)
	for idx, n := range f.replicas[db] {
		if len(n.pending) == 0 {
			continue
		}
		keep := n.pending[:0]
		for _, o := range n.pending {
			switch {
			case o.ObservedAt.Before(cutoff):
				f.met.reject(feedRejectUnverified)
				continue
			case held(&o, p) && p.insertAt.Before(o.ReadBy):
				keep = append(keep, o)
				continue
			}
			prev := ds.Replicas[idx]
			next, ch := mergeReplica(prev, o, p, f.t.cfg)
			ds.Replicas[idx] = next
			out = append(out, pendingMerge{idx: idx, prev: prev, next: next, ch: ch})
			if !ch.impossible && !ch.superseded {
				n.fedAt.Store(f.t.cfg.Now().UnixNano())
			}
		}
		clear(n.pending[len(keep):])
		n.pending = keep
	}
	return out
}

// reject counts and logs (rate-limited per reason) a feed observation the
// router does not merge.
func (f *feedState) reject(reason feedReject, d *FeedDelivery, detail error) {
	f.met.reject(reason)
	f.warn[reason].Do(func() {
		level := slog.LevelWarn
		if reason == feedRejectUnknownNode || reason == feedRejectUnconfirmed {
			level = slog.LevelInfo // another application's nodes; a node the router is still polling
		}
		attrs := []any{slog.String("reason", reason.String()), slog.String("publisher", d.Publisher.String()),
			slog.String(attrDatabase, d.Database), slog.String("node", d.Node), slog.String("role", d.Role.String())}
		if detail != nil {
			attrs = append(attrs, slog.Any("error", detail))
		}
		f.log.Log(f.t.ctx, level, "caughtup: feed observation not believed; it changes nothing (logged at most every 10s per reason; see caughtup.consume.feed.observations.rejected)", attrs...)
	})
}

// feedObservation is what a Publisher sends for an observation of the
// tracker's: the values, and when they were read. A replica's are stamped
// with the time its query returned (its ReadBy), by which they had
// certainly been read, so that a router can compare them with a primary
// observation made later; a primary's with the time its query was sent.
func feedObservation(database, node string, o any) FeedObservation {
	out := FeedObservation{Database: database, Node: node}
	switch o := o.(type) {
	case PrimaryObservation:
		out.Role, out.PolledAt = FeedRolePrimary, o.ObservedAt
		if o.Err != nil {
			out.Err = o.Err.Error()
			break
		}
		out.Primary = FeedPrimaryStatus{Epoch: o.Epoch, InsertLSN: o.InsertLSN, WAL: o.WAL,
			History: o.History, HistoryKnown: o.HistoryKnown}
	case ReplicaObservation:
		out.Role, out.PolledAt = FeedRoleReplica, o.ReadBy
		if out.PolledAt.IsZero() {
			out.PolledAt = o.ObservedAt
		}
		if o.Err != nil {
			out.Err = o.Err.Error()
			break
		}
		out.Replica = FeedReplicaStatus{InRecovery: o.InRecovery, Replayed: o.Replayed.LSN,
			ReplayTimestamp: o.ReplayTimestamp, TimeLag: o.TimeLag,
			Incarnation: o.Incarnation.PostmasterStart, RecoveryStart: o.Incarnation.RecoveryStart}
		if o.Replayed.Epoch.Timeline != 0 {
			out.Replica.Epoch = o.Replayed.Epoch
		}
	}
	return out
}
