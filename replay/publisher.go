package replay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"golang.org/x/time/rate"
)

// DefaultFeedInterval is PublisherConfig.PollInterval's default: how
// often a Publisher polls every node. Routers on the feed learn that a
// replica caught up within a few milliseconds, as a router polling by
// itself does while a job waits, at 100 queries/s per publisher to each
// replica whatever the number of routers (docs/measurements.md).
const DefaultFeedInterval = 10 * time.Millisecond

// DefaultFeedHeartbeat is PublisherConfig.Heartbeat's default: how often
// a Publisher publishes a node whose observation has not changed. Ten
// polls at the default interval and five heartbeats per router's default
// SilenceBound (500ms), so a router finds a node silent only when several
// in a row are lost, while an idle node costs a tenth of the messages of
// publishing every poll (docs/measurements.md).
const DefaultFeedHeartbeat = 100 * time.Millisecond

// PublisherConfig configures a Publisher. The zero value of every field
// but Feed means its documented default.
type PublisherConfig struct {
	// Feed is where the observations go: on Redis, a feed.Sender
	// (feed.NewSender with the Redis, the feed's name, this publisher's
	// name, unique among the feed's publishers, and the keys it signs
	// with). Required. The Publisher takes it over: Close closes it, and
	// so does a NewPublisher that fails.
	Feed FeedSender

	// PollInterval: every PollInterval each database's replicas are
	// polled together, then its primary, and each observation is
	// published as soon as it is read. Polling the primary after the
	// replicas lets a router confirm within the round that no replica
	// claims more than the primary had inserted. Negative is refused.
	// Default: DefaultFeedInterval (10ms).
	// A catch-up reaches the routers within a few milliseconds.
	PollInterval time.Duration

	// Heartbeat: each node's observation is published when it differs
	// from the last one published of that node (its position, epoch, run,
	// timeline history, recovery state or error), and otherwise once
	// Heartbeat has passed since that one. A change goes out in the poll
	// that saw it; an idle node costs a message per Heartbeat. Replay
	// timestamps and time lag do not count as changes (an idle replica's
	// time lag grows with every poll): routers see them at most a
	// Heartbeat old. Keep it several times below the routers'
	// FeedConfig.SilenceBound, after which a router polls a node the feed
	// is silent about. Negative publishes every poll.
	// Default: DefaultFeedHeartbeat (100ms).
	// Five heartbeats per default SilenceBound; an idle node costs a tenth
	// of the messages of publishing every poll.
	Heartbeat time.Duration

	// Logger receives poll and publish failures (rate-limited).
	// Default: slog.Default().
	Logger *slog.Logger

	// MeterProvider records the feed publisher's instruments
	// (caughtup.feed.published, …).
	// Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

// Publisher polls every node of its databases and publishes what it reads
// to a position feed that Routers subscribe to (Config.Feed). A feed needs
// a few publishers for redundancy, no leader: routers merge them. Run one
// embedded in any long-lived process (a worker, a web server), or as the
// `caughtup feed` command (a sidecar, a deployment of two).
type Publisher struct {
	tr  *Tracker
	pub FeedSender
	log *slog.Logger

	heartbeat time.Duration
	// now is the tracker's clock, kept here because the tracker's pollers
	// publish before NewPublisher has stored the tracker in tr.
	now func() time.Time
	// sentMu guards sent: the last observation of each node handed to
	// the feed, and when.
	sentMu    sync.Mutex
	sent      map[feedNodeKey]sentObservation
	unchanged metric.Int64Counter
	counted   metric.MeasurementOption

	warn      rate.Sometimes
	closeOnce sync.Once
	closeErr  error
}

var _ observationSink = (*Publisher)(nil)

// NewPublisher validates dbs and cfg, starts polling the nodes of dbs and
// publishing what it reads, and waits until every node has been polled
// once (or ctx ends). ctx bounds only this start; the Publisher runs until
// Close.
//
// dbs are the nodes to poll, as a Router's. A replica's Name is what
// routers match observations by: publishers and routers must name every
// replica alike (and the database too). A router believes nothing of a
// name it does not have, polls a replica the feed does not report by
// itself, and notices a name that means another server (another system,
// or a run of the server that its own poll contradicts) and ignores the
// feed's observations of it: a mismatch costs the fleet queries, never
// freshness. The pools stay the caller's; the
// Publisher makes its own one-connection pool per node from their
// configs, as a Tracker does.
func NewPublisher(ctx context.Context, dbs map[string]Database, cfg PublisherConfig) (_ *Publisher, err error) {
	if cfg.Feed == nil {
		return nil, fmt.Errorf("%w: PublisherConfig.Feed is required (on Redis, a feed.Sender: feed.NewSender)", ErrInvalidConfig)
	}
	pub := cfg.Feed
	defer func() {
		if err != nil {
			_ = pub.Close()
		}
	}()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = DefaultFeedInterval
	}
	if cfg.PollInterval < 0 {
		return nil, fmt.Errorf("%w: PublisherConfig.PollInterval must be positive", ErrInvalidConfig)
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = DefaultFeedHeartbeat
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := ValidateDatabases(dbs); err != nil {
		return nil, err
	}
	dbs = cloneDatabases(dbs)
	// The tracker's own instruments (lag, restarts, divergence) belong to
	// the Routers: a Publisher in the same process must not report them
	// twice.
	tcfg := TrackerConfig{
		PollInterval:     cfg.PollInterval,
		WaitPollInterval: cfg.PollInterval,
		Logger:           cfg.Logger,
	}.WithDefaults()
	if err := tcfg.Validate(); err != nil {
		return nil, fmt.Errorf("PublisherConfig: %w", err)
	}
	p := &Publisher{pub: pub, log: cfg.Logger, warn: rate.Sometimes{First: 1, Interval: 10 * time.Second},
		heartbeat: cfg.Heartbeat, now: tcfg.Now, sent: make(map[feedNodeKey]sentObservation)}
	mp := cfg.MeterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	p.counted = metric.WithAttributeSet(attribute.NewSet(semconv.DBSystemNamePostgreSQL,
		semconv.MessagingDestinationName(pub.Destination())))
	if p.unchanged, err = mp.Meter(ScopeName).Int64Counter("caughtup.consume.publisher.unchanged",
		metric.WithUnit("{observation}"),
		metric.WithDescription("Observations a Publisher did not publish because they equal the last one published of the node and its heartbeat was not due (PublisherConfig.Heartbeat).")); err != nil {
		return nil, fmt.Errorf("caughtup/replay: creating the publisher's instruments: %w", err)
	}
	if p.tr, err = newTracker(dbs, &tcfg, trackerOptions{rounds: true, sink: p, noMetrics: true}); err != nil {
		return nil, err
	}
	cfg.Logger.Info("caughtup: publishing replica positions to the feed",
		slog.String("channel", pub.Destination()), slog.String("publisher", pub.ID().String()),
		slog.Duration("interval", cfg.PollInterval), slog.Duration("heartbeat", cfg.Heartbeat))
	select {
	case <-p.tr.initDone:
	case <-ctx.Done():
		_ = p.tr.Close()
		return nil, ctx.Err()
	}
	return p, nil
}

// ID is the feed sender's name and instance.
func (p *Publisher) ID() PublisherID { return p.pub.ID() }

// Snapshot is what the Publisher's own polls merged into: the same state
// a Router keeps. It is shared and immutable.
func (p *Publisher) Snapshot() *Snapshot { return p.tr.snapshot() }

// Flush waits until every observation published so far has been sent to
// the feed (or failed); see FeedSender.Flush.
func (p *Publisher) Flush(ctx context.Context) error { return p.pub.Flush(ctx) }

// Close stops polling, closes the Publisher's connections, sends what is
// waiting and closes its FeedSender. It does not close the application's
// pools (nor, on Redis, the client). Idempotent.
func (p *Publisher) Close() error {
	p.closeOnce.Do(func() {
		_ = p.tr.Close()
		p.closeErr = p.pub.Close()
	})
	return p.closeErr
}

func (p *Publisher) replica(rp *replicaPoller, o ReplicaObservation) {
	p.publish(feedObservation(rp.dbName, rp.name, o))
}

func (p *Publisher) primary(pp *primaryPoller, o PrimaryObservation) {
	p.publish(feedObservation(pp.dbName, "", o))
}

func (p *Publisher) publish(o FeedObservation) {
	key := feedNodeKey{o.Database, o.Node, o.Role}
	now := p.now()
	p.sentMu.Lock()
	defer p.sentMu.Unlock()
	prev, ok := p.sent[key]
	if !publishDue(prev, ok, &o, now, p.heartbeat) {
		p.unchanged.Add(context.Background(), 1, p.counted)
		return
	}
	err := p.pub.Publish(o)
	if err == nil {
		p.sent[key] = sentObservation{obs: o, at: now}
		return
	}
	// Not queued: the node's next poll publishes, changed or not.
	delete(p.sent, key)
	if errors.Is(err, ErrFeedClosed) {
		return
	}
	// feed.ErrBacklog: Redis is slower than the polls; the feed counts it.
	p.warn.Do(func() {
		p.log.Warn("caughtup: an observation was not published (logged at most every 10s; see caughtup.feed.publish.dropped)",
			slog.String(attrDatabase, o.Database), slog.String("node", o.Node), slog.Any("error", err))
	})
}

// runRounds polls database db's replicas together, then its primary, once
// per PollInterval (measured from the start of each round), until the
// tracker stops. The primary after the replicas: its insert position then
// bounds what they reported, so that a router can check the replicas'
// claims within the round (see held). A node whose poll has not returned
// is not polled again until it has, and a round waits for its replicas at
// most one PollInterval before it polls the primary: one hung replica does
// not stop the feed of the others.
func (t *Tracker) runRounds(db int) {
	defer t.wg.Done()
	replicas, primary := t.replicas[db], t.primarys[db]
	busy := make([]atomic.Bool, len(replicas)+1) // the replicas, then the primary
	polled := make([]atomic.Bool, len(replicas)+1)
	poll := func(i int, f func(), done chan<- struct{}) bool {
		if !busy[i].CompareAndSwap(false, true) {
			return false
		}
		t.wg.Go(func() {
			f()
			busy[i].Store(false)
			if !polled[i].Swap(true) {
				t.initialized()
			}
			if done != nil {
				done <- struct{}{}
			}
		})
		return true
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	wait := func(d time.Duration, done <-chan struct{}, n int) bool {
		timer.Reset(d)
		defer timer.Stop()
		for n > 0 || done == nil {
			select {
			case <-t.ctx.Done():
				return false
			case <-timer.C:
				return true
			case <-done:
				n--
			}
		}
		return true
	}
	for t.ctx.Err() == nil {
		start := t.cfg.Now()
		done := make(chan struct{}, len(replicas))
		n := 0
		for i, p := range replicas {
			if poll(i, func() { t.pollReplica(p) }, done) {
				n++
			}
		}
		if !wait(t.cfg.PollInterval, done, n) {
			return
		}
		poll(len(replicas), func() { t.pollPrimary(primary) }, nil)
		if d := start.Add(t.cfg.PollInterval).Sub(t.cfg.Now()); d > 0 && !wait(d, nil, 0) {
			return
		}
	}
}

// feedNodeKey names one node of a Publisher's feed.
type feedNodeKey struct {
	database, node string
	role           FeedRole
}

// sentObservation is the last observation of a node a Publisher handed to
// the feed, and when.
type sentObservation struct {
	obs FeedObservation
	at  time.Time
}

// publishDue decides whether a Publisher publishes o (see
// PublisherConfig.Heartbeat): always with a negative heartbeat or nothing
// sent yet (ok false), when o's state differs from prev's, and once
// heartbeat has passed since prev was sent.
func publishDue(prev sentObservation, ok bool, o *FeedObservation, now time.Time, heartbeat time.Duration) bool {
	return heartbeat < 0 || !ok || !prev.obs.SameState(o) || now.Sub(prev.at) >= heartbeat
}
