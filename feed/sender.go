package feed

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/sign"
)

// ErrBacklog is returned by Publish when MaxPending nodes already have an
// observation waiting to be sent: Redis is slower than the polls, and
// this observation is dropped (counted). The node's next poll tries again.
var ErrBacklog = errors.New("caughtup/feed: publisher backlog full; observation dropped (is Redis slow or unreachable?)")

// SenderConfig configures a Sender. The zero value of every field
// but Client means its documented default; WithDefaults fills them in.
type SenderConfig struct {
	// Client is the Redis to publish to: a *redis.Client, a
	// *redis.ClusterClient, or a Sentinel-backed failover client (see
	// docs/feed.md, "Redis: keys, Cluster, Sentinel"). Required. The
	// Sender never closes it.
	Client redis.UniversalClient

	// Feed names the feed: publishers and subscribers of one feed share
	// it, and it is part of every key, the channel and every MAC (so a
	// message of one feed never verifies on another).
	// Default: DefaultFeed ("default").
	Feed string

	// Name identifies this publisher across restarts, e.g. the host or
	// pod name; each process adds a random instance ID to it. Stored
	// values are kept per Name, so two publishers of one feed must not
	// share one.
	// Default: the host name ("publisher" if it is not a valid name).
	// It is already unique per host and stable across restarts.
	Name string

	// Keys: the publisher signs every message with Keys.Current. Required
	// unless Insecure.
	Keys Keyring

	// Insecure publishes unsigned messages when Keys is empty. It is
	// logged at NewSender.
	// Default: false.
	// Unsigned, anyone who can publish on the channel could move every
	// router in the fleet; that must be asked for.
	Insecure bool

	// TTL is the expiry the latest value of each node is stored with (SET
	// … PX). A subscriber measures a stored value's age as TTL minus its
	// remaining PTTL, both on Redis's clock; values of a publisher that
	// stopped disappear after it. Under 1ms (but not zero) is refused:
	// Redis expiries are whole milliseconds.
	// Default: 10s.
	// Ten times replay's default staleness bound, so a stored value is old
	// enough to be recognised as stale before it vanishes, and a stopped
	// publisher's values are gone within seconds.
	TTL time.Duration

	// MaxPending bounds the nodes with an observation waiting to be sent;
	// beyond it Publish returns ErrBacklog. A newer observation of a node
	// replaces a waiting one (counted as superseded), so the backlog never
	// holds more than one per node. Must not be negative.
	// Default: 1024.
	// Far more nodes than one publisher polls.
	MaxPending int

	// Timeout bounds each pipeline to Redis. Must not be negative.
	// Default: 1s.
	// A pipeline is a few commands per node, and a Redis that takes a
	// second will be judged silent by subscribers anyway.
	Timeout time.Duration

	// Logger receives failures (rate-limited) and recoveries.
	// Default: slog.Default().
	Logger *slog.Logger

	// MeterProvider records the publisher's instruments.
	// Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

// WithDefaults returns c with every zero field set to its default.
func (c SenderConfig) WithDefaults() SenderConfig {
	if c.Feed == "" {
		c.Feed = DefaultFeed
	}
	if c.Name == "" {
		c.Name, _ = os.Hostname()
		if checkName("", c.Name, false) != nil {
			c.Name = "publisher"
		}
	}
	if c.TTL == 0 {
		c.TTL = 10 * time.Second
	}
	if c.MaxPending == 0 {
		c.MaxPending = 1024
	}
	if c.Timeout == 0 {
		c.Timeout = time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	return c
}

// Validate reports what is wrong with c, after defaults.
func (c SenderConfig) Validate() error {
	if c.Client == nil {
		return fmt.Errorf("%w: SenderConfig.Client is required (a go-redis UniversalClient)", ErrInvalidConfig)
	}
	if err := checkFeed(c.Feed); err != nil {
		return err
	}
	if err := checkName("publisher name", c.Name, false); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if err := checkKeys(c.Keys); err != nil {
		return err
	}
	if len(c.Keys.Keys) == 0 && !c.Insecure {
		return fmt.Errorf("%w: SenderConfig.Keys is empty; configure a key (GenerateKey, ParseKeys) or set Insecure: true to publish unsigned messages that subscribers must also be told to accept", ErrInvalidConfig)
	}
	if c.TTL < time.Millisecond {
		return fmt.Errorf("%w: SenderConfig.TTL %v is below 1ms; Redis expiries are whole milliseconds", ErrInvalidConfig, c.TTL)
	}
	if c.MaxPending < 1 {
		return fmt.Errorf("%w: SenderConfig.MaxPending must be at least 1", ErrInvalidConfig)
	}
	if c.Timeout <= 0 {
		return fmt.Errorf("%w: SenderConfig.Timeout must be positive", ErrInvalidConfig)
	}
	return nil
}

// PublisherID identifies one publisher process: the configured name and a
// random instance ID drawn when the Sender is made (replay.PublisherID).
type PublisherID = replay.PublisherID

type nodeID struct {
	database, node string
	role           Role
}

// A Sender signs, stores and publishes a publisher's observations: the
// replay.FeedSender of a replay.Publisher (PublisherConfig.Feed). Publish
// never blocks on Redis: observations wait in a bounded backlog (at most
// one per node), and one goroutine sends them in pipelines. Safe for
// concurrent use.
type Sender struct {
	cfg     SenderConfig
	id      PublisherID
	channel string
	index   string
	keyID   string
	macs    *sign.MACs
	log     *slog.Logger
	m       *publisherMetrics
	reg     metric.Registration

	mu       sync.Mutex
	pending  map[nodeID]Observation
	gen      uint64 // Publish calls accepted so far
	closed   bool
	flushers []*flusher
	doneGen  uint64 // gen when the last non-empty batch was taken
	doneErr  error  // and how it went

	wake chan struct{}
	done chan struct{}

	// Sender goroutine only.
	seq     uint64
	failing bool
	warned  time.Time
	sharded bool // SPUBLISH rather than PUBLISH (see cluster.go)
}

var _ replay.FeedSender = (*Sender)(nil)

type flusher struct {
	target uint64
	err    error
	ch     chan error
}

// NewSender validates cfg and starts the sending goroutine; Close
// stops it.
func NewSender(cfg SenderConfig) (*Sender, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Keys = cfg.Keys.Clone()
	var b [8]byte
	_, _ = rand.Read(b[:])
	p := &Sender{
		cfg:     cfg,
		id:      PublisherID{Name: cfg.Name, Instance: binary.BigEndian.Uint64(b[:])},
		channel: ChannelName(cfg.Feed),
		index:   indexKey(cfg.Feed),
		macs:    newMACs(cfg.Feed, cfg.Keys.Keys),
		log:     cfg.Logger.With(slog.String("feed", cfg.Feed)),
		pending: make(map[nodeID]Observation),
		wake:    make(chan struct{}, 1),
		done:    make(chan struct{}),
		sharded: shardedClient(cfg.Client),
	}
	if k := cfg.Keys.Signer(); k != nil {
		p.keyID = k.ID
	} else {
		p.log.Warn("caughtup/feed: publishing UNSIGNED observations (Insecure: true); anyone who can publish on the channel can move every router",
			slog.String("channel", p.channel))
	}
	m, err := newPublisherMetrics(cfg.MeterProvider, p.channel)
	if err != nil {
		return nil, fmt.Errorf("caughtup/feed: metrics: %w", err)
	}
	p.m = m
	p.reg, err = cfg.MeterProvider.Meter(ScopeName).RegisterCallback(func(_ context.Context, o metric.Observer) error {
		p.mu.Lock()
		n := len(p.pending)
		p.mu.Unlock()
		o.ObserveInt64(m.pending, int64(n), m.all)
		return nil
	}, m.pending)
	if err != nil {
		return nil, fmt.Errorf("caughtup/feed: metrics: %w", err)
	}
	go p.run()
	return p, nil
}

// ID returns this publisher's name and instance.
func (p *Sender) ID() PublisherID { return p.id }

// Destination is the feed's pub/sub channel (ChannelName).
func (p *Sender) Destination() string { return p.channel }

// Publish queues o to be signed, stored as its node's latest value and
// published. It does not wait for Redis. It fails only for an
// observation no subscriber would accept (a name too long, an unknown
// role), after Close (ErrClosed), and when the backlog is full
// (ErrBacklog). A timeline history longer than MaxHistory is dropped: the
// primary's history then travels as unknown, which makes routers read
// tokens of older timelines from the primary. An observation of a node
// that is still waiting replaces the waiting one.
func (p *Sender) Publish(o Observation) error {
	if o.Role == RolePrimary && len(o.Primary.History) > MaxHistory {
		o.Primary.History, o.Primary.HistoryKnown = nil, false
	}
	if err := checkObservation(&o); err != nil {
		return err
	}
	if o.PolledAt.IsZero() {
		o.PolledAt = time.Now()
	}
	id := nodeID{database: o.Database, node: o.Node, role: o.Role}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	_, replaced := p.pending[id]
	if !replaced && len(p.pending) >= p.cfg.MaxPending {
		p.mu.Unlock()
		p.m.dropped.Add(context.Background(), 1, p.m.backlogFull)
		return ErrBacklog
	}
	p.pending[id] = o
	p.gen++
	p.mu.Unlock()
	if replaced {
		p.m.dropped.Add(context.Background(), 1, p.m.superseded)
	}
	p.kick()
	return nil
}

func (p *Sender) kick() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// Flush waits until every observation Publish accepted before the call
// has been sent (or has failed, or was superseded), and returns the error
// of the pipeline that carried the last of them (joined with those of
// pipelines that completed while it waited).
func (p *Sender) Flush(ctx context.Context) error {
	f := &flusher{ch: make(chan error, 1)}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	f.target = p.gen
	if f.target <= p.doneGen {
		// The last observation accepted has already gone out, in the
		// last batch sent.
		err := p.doneErr
		p.mu.Unlock()
		return err
	}
	p.flushers = append(p.flushers, f)
	p.mu.Unlock()
	p.kick()
	select {
	case err := <-f.ch:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close sends what is waiting (within Timeout), stops the sending
// goroutine and unregisters the gauge. It does not close the Redis
// client. Idempotent.
func (p *Sender) Close() error {
	p.mu.Lock()
	already := p.closed
	p.closed = true
	p.mu.Unlock()
	p.kick()
	<-p.done
	if !already {
		return p.reg.Unregister()
	}
	return nil
}

func (p *Sender) run() {
	defer close(p.done)
	for range p.wake {
		for {
			p.mu.Lock()
			// The batch is the pending map itself, swapped for a new one;
			// an empty one stays Publish's, and is not to be read unlocked.
			var batch map[nodeID]Observation
			if len(p.pending) > 0 {
				batch = p.pending
				p.pending = make(map[nodeID]Observation, len(batch))
			}
			gen, closed := p.gen, p.closed
			p.mu.Unlock()

			err := p.send(batch)

			p.mu.Lock()
			if len(batch) > 0 {
				p.doneGen, p.doneErr = gen, err
			}
			kept := p.flushers[:0]
			var reply []*flusher
			for _, f := range p.flushers {
				f.err = errors.Join(f.err, err)
				if f.target <= gen {
					reply = append(reply, f)
				} else {
					kept = append(kept, f)
				}
			}
			clear(p.flushers[len(kept):])
			p.flushers = kept
			more := len(p.pending) > 0
			p.mu.Unlock()
			for _, f := range reply {
				f.ch <- f.err
			}
			if closed {
				p.mu.Lock()
				for _, f := range p.flushers {
					f.ch <- ErrClosed
				}
				p.flushers = nil
				p.mu.Unlock()
				return
			}
			if !more {
				break
			}
		}
	}
}

// send stores and publishes one batch in one pipeline: per observation a
// SET with expiry and a PUBLISH (SPUBLISH in a Cluster) of the same
// bytes, then one SADD of the keys to the index and a PEXPIRE of the
// index.
func (p *Sender) send(batch map[nodeID]Observation) error {
	if len(batch) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Timeout)
	defer cancel()
	pipe := p.cfg.Client.Pipeline()
	keys := make([]any, 0, len(batch))
	type sent struct{ set, pub redis.Cmder }
	cmds := make([]sent, 0, len(batch))
	now := time.Now()
	for _, o := range batch {
		b, err := p.encode(&o, now)
		if err != nil {
			// Publish checked what encoding checks; this is a bug.
			p.log.Error("caughtup/feed: cannot encode an observation", slog.Any("error", err))
			continue
		}
		key := valueKey(p.cfg.Feed, p.cfg.Name, &o)
		keys = append(keys, key)
		c := sent{set: pipe.Set(ctx, key, b, p.cfg.TTL)}
		if p.sharded {
			c.pub = pipe.SPublish(ctx, p.channel, b)
		} else {
			c.pub = pipe.Publish(ctx, p.channel, b)
		}
		cmds = append(cmds, c)
	}
	if len(keys) > 0 {
		pipe.SAdd(ctx, p.index, keys...)
		pipe.PExpire(ctx, p.index, p.cfg.TTL)
	}
	_, err := pipe.Exec(ctx)
	// A network error or timeout may leave commands without an error of
	// their own: then none counts as sent. A server's error reply (e.g.
	// NOPERM) is set on the very command it answered.
	var ok int64
	var serverErr redis.Error
	if err == nil || errors.As(err, &serverErr) {
		for _, c := range cmds {
			if c.set.Err() == nil && c.pub.Err() == nil {
				ok++
			}
		}
	}
	bg := context.Background()
	if err != nil {
		reloadSlots(bg, p.cfg.Client)
		if p.sharded && len(cmds) > 0 && unknownCommand(cmds[0].pub.Err()) {
			p.sharded = false
			p.log.Warn("caughtup/feed: this Redis Cluster does not know SPUBLISH (Redis before 7.0); publishing with classic PUBLISH, which subscribers detect alike",
				slog.String("publisher", p.id.String()))
		}
	}
	if ok > 0 {
		p.m.published.Add(bg, ok)
	}
	if failed := int64(len(cmds)) - ok; failed > 0 {
		p.m.failed.Add(bg, failed, p.m.failedBy[classify(err)])
	}
	switch {
	case err != nil:
		// The first failure of a run, then one line per 10s.
		if !p.failing || time.Since(p.warned) >= 10*time.Second {
			p.warned = time.Now()
			p.log.Warn("caughtup/feed: publishing failed; subscribers will judge the feed silent if this lasts",
				slog.String("publisher", p.id.String()), slog.Int("observations", len(cmds)), slog.Any("error", err))
		}
		p.failing = true
	case p.failing:
		p.failing = false
		p.log.Info("caughtup/feed: publishing again", slog.String("publisher", p.id.String()))
	}
	return err
}

// encode signs o into a fresh slice (the pipeline keeps it until Exec).
func (p *Sender) encode(o *Observation, now time.Time) ([]byte, error) {
	p.seq++
	m := message{
		keyID:     p.keyID,
		publisher: p.cfg.Name,
		instance:  p.id.Instance,
		seq:       p.seq,
		sentAt:    now,
		ttl:       p.cfg.TTL,
		held:      now.Sub(o.PolledAt),
		obs:       *o,
	}
	b, err := appendMessage(make([]byte, 0, 160), &m)
	if err != nil {
		return nil, err
	}
	if m.keyID != "" {
		b = append(b, p.macs.Sum(m.keyID, b)...)
	}
	return b, nil
}
