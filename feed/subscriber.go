package feed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/internal/retry"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/sign"
)

// rejectReason says why a subscriber refused a message, as the
// caughtup.reason attribute of caughtup.feed.rejected (the values are
// listed in the package documentation).
type rejectReason uint8

const (
	// rejectMalformed: the message does not parse (see FormatError).
	rejectMalformed rejectReason = iota
	// rejectUnsupportedVersion: a format version this subscriber does not
	// read.
	rejectUnsupportedVersion
	// rejectUnsigned: no signature, and the subscriber is not Insecure.
	rejectUnsigned
	// rejectUnknownKey: signed with a key ID the subscriber's Keyring does
	// not hold.
	rejectUnknownKey
	// rejectBadSignature: the MAC does not verify under the named key.
	rejectBadSignature
	// rejectReplayed: its publisher instance already superseded it (its
	// sequence number is at or below the highest seen for that node).
	rejectReplayed
	// rejectBadExpiry: a stored value whose Redis expiry no publisher sets
	// (none, or longer than the TTL the message was signed with), so its
	// age cannot be measured.
	rejectBadExpiry
	numRejectReasons
)

var rejectNames = [numRejectReasons]string{"malformed", "unsupported_version", "unsigned", "unknown_key", "bad_signature", "replayed", "bad_expiry"}

// String returns the reason's metric attribute value, e.g. "bad_signature".
func (r rejectReason) String() string {
	if r < numRejectReasons {
		return rejectNames[r]
	}
	return "reject(" + strconv.Itoa(int(r)) + ")"
}

// A subscriber's health and deliveries are replay's values: the
// Subscriber is a replay.FeedSource.

// State is a subscription's health (replay.FeedState).
type State = replay.FeedState

// The states, replay's.
const (
	StateConnecting  = replay.FeedConnecting
	StateSubscribed  = replay.FeedSubscribed
	StateSilent      = replay.FeedSilent
	StateUnreachable = replay.FeedUnreachable
	StateDropped     = replay.FeedDropped
	StateStopped     = replay.FeedStopped
	numStates        = StateStopped + 1
)

// Health is a subscription's state and since when, on the subscriber's
// clock (replay.FeedHealth).
type Health = replay.FeedHealth

// Delivery is one authentic observation as a subscriber accepted it
// (replay.FeedDelivery; its values are its FeedObservation).
type Delivery = replay.FeedDelivery

// SubscriberConfig configures a Subscriber. The zero value of every field
// but Client means its documented default; WithDefaults fills them in.
type SubscriberConfig struct {
	// Client is the Redis to subscribe to (see SenderConfig.Client).
	// Required. The Subscriber never closes it.
	Client redis.UniversalClient

	// Feed names the feed.
	// Default: DefaultFeed ("default").
	Feed string

	// Keys: a message is accepted only when signed with one of Keys.
	// Required unless Insecure.
	Keys Keyring

	// Insecure accepts unsigned messages, and signed ones whose key is not
	// in Keys (they cannot be checked), while still rejecting a signature
	// that does not verify under a known key. With Keys empty this turns
	// authentication off; with Keys set it is the step to enable signing
	// without downtime (configure subscribers with Keys and Insecure, then
	// publishers with Keys, then drop Insecure). Logged at NewSubscriber.
	// Default: false.
	// An unsigned message could come from anyone who can publish on the
	// channel; accepting them must be asked for.
	Insecure bool

	// OnObservation receives every accepted observation of Run's
	// subscription, from Run's goroutine, one at a time, stored values
	// first after each (re)subscription. Keep it fast: the next message
	// waits. Required by Run; a tracker (Subscribe) brings its own.
	OnObservation func(Delivery)

	// OnHealth receives every health change of Run's subscription, from
	// Run's goroutine. Optional.
	OnHealth func(Health)

	// SilenceBound: with no authentic observation for this long the feed
	// is StateSilent; the state changes within SilenceBound plus a quarter
	// of it. Rejected messages do not count: a flood of forgeries cannot
	// keep a dead feed looking alive. Must not be negative. A tracker's
	// subscription uses its own (replay.FeedConfig.SilenceBound).
	// Default: 1s.
	// The default staleness bound of the router's tracker
	// (replay.DefaultStalenessBound).
	SilenceBound time.Duration

	// PingInterval: after this long with nothing read the subscriber
	// PINGs Redis, and drops the subscription (StateDropped) when no
	// answer comes within ReadTimeout, so a half-open connection is
	// noticed. Must not be negative.
	// Default: 1s.
	PingInterval time.Duration

	// ReadTimeout bounds the SUBSCRIBE confirmation, each read of the
	// stored values and the answer to a PING. Must not be negative.
	// Default: 2s.
	ReadTimeout time.Duration

	// MinBackoff and MaxBackoff bound the exponential backoff between
	// attempts to (re)subscribe. Neither may be negative, and MaxBackoff
	// must be at least MinBackoff.
	// Default: 50ms and 2s.
	// A restarted Redis is back within a fraction of a second, and a fleet
	// of subscribers retrying every 2s costs it nothing.
	MinBackoff, MaxBackoff time.Duration

	// MaxStreams bounds the replay memory: the highest sequence number per
	// publisher instance and node. Beyond it the streams heard from least
	// recently are forgotten (a replay of their old messages is then
	// accepted once; see docs/feed.md, "Replays"). Must not be negative.
	// Default: 65536.
	MaxStreams int

	// MaxStored bounds the stored values read per (re)subscription. Must
	// not be negative.
	// Default: 4096.
	MaxStored int

	// Logger receives health changes and rejected messages (rate-limited
	// per reason).
	// Default: slog.Default().
	Logger *slog.Logger

	// MeterProvider records the subscriber's instruments.
	// Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

// WithDefaults returns c with every zero field set to its default.
func (c SubscriberConfig) WithDefaults() SubscriberConfig {
	if c.Feed == "" {
		c.Feed = DefaultFeed
	}
	if c.SilenceBound == 0 {
		c.SilenceBound = time.Second
	}
	if c.PingInterval == 0 {
		c.PingInterval = time.Second
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = 2 * time.Second
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = 50 * time.Millisecond
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 2 * time.Second
	}
	if c.MaxStreams == 0 {
		c.MaxStreams = 1 << 16
	}
	if c.MaxStored == 0 {
		c.MaxStored = 4096
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
func (c SubscriberConfig) Validate() error {
	if c.Client == nil {
		return fmt.Errorf("%w: SubscriberConfig.Client is required (a go-redis UniversalClient)", ErrInvalidConfig)
	}
	if err := checkFeed(c.Feed); err != nil {
		return err
	}
	if err := checkKeys(c.Keys); err != nil {
		return err
	}
	if len(c.Keys.Keys) == 0 && !c.Insecure {
		return fmt.Errorf("%w: SubscriberConfig.Keys is empty; configure the publishers' keys (ParseKeys) or set Insecure: true to believe unsigned observations", ErrInvalidConfig)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"SilenceBound", c.SilenceBound}, {"PingInterval", c.PingInterval}, {"ReadTimeout", c.ReadTimeout}, {"MinBackoff", c.MinBackoff}, {"MaxBackoff", c.MaxBackoff}} {
		if d.v <= 0 {
			return fmt.Errorf("%w: SubscriberConfig.%s must be positive", ErrInvalidConfig, d.name)
		}
	}
	if c.MaxBackoff < c.MinBackoff {
		return fmt.Errorf("%w: SubscriberConfig.MaxBackoff is below MinBackoff", ErrInvalidConfig)
	}
	if c.MaxStreams < 1 || c.MaxStored < 1 {
		return fmt.Errorf("%w: SubscriberConfig.MaxStreams and MaxStored must be at least 1", ErrInvalidConfig)
	}
	return nil
}

// streamKey is one publisher instance's stream of observations of one
// node: sequence numbers only grow along it.
type streamKey struct {
	publisher string
	instance  uint64
	database  string
	node      string
	role      Role
}

type streamState struct {
	seq       uint64
	fromStore bool // seq was read from the store and not yet seen live
	heard     time.Time
}

// Subscriber reads a feed: the stored latest values on each
// (re)subscription, then the live messages, delivering the authentic,
// unsuperseded ones. It is the replay.FeedSource of the trackers of a
// fleet (replay.FeedConfig.Source): each tracker's Subscribe is a
// subscription of its own. Run is one more, delivering to the config's
// callbacks. Make one with NewSubscriber.
type Subscriber struct {
	cfg         SubscriberConfig
	channel     string
	index       string
	valuePrefix string
	log         *slog.Logger
	m           *subscriberMetrics
	running     atomic.Bool

	// Run's subscription, for Health.
	mu  sync.Mutex
	run *subscription
}

var _ replay.FeedSource = (*Subscriber)(nil)

// subscription is one Subscribe (or Run): its callbacks, health and
// replay memory.
type subscription struct {
	*Subscriber
	onObservation func(Delivery)
	onHealth      func(Health)
	silence       time.Duration

	mu     sync.Mutex
	health Health

	// The subscription's goroutine only.
	macs    *sign.MACs
	streams map[streamKey]*streamState
	warn    [numRejectReasons]rate.Sometimes
	sharded bool // SSUBSCRIBE rather than SUBSCRIBE (see cluster.go)
}

// NewSubscriber validates cfg; nothing runs until Subscribe or Run.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Keys = cfg.Keys.Clone()
	s := &Subscriber{
		cfg:         cfg,
		channel:     ChannelName(cfg.Feed),
		index:       indexKey(cfg.Feed),
		valuePrefix: hashTag(cfg.Feed) + ":latest:",
		log:         cfg.Logger.With(slog.String("feed", cfg.Feed)),
	}
	m, err := newSubscriberMetrics(cfg.MeterProvider, s.channel)
	if err != nil {
		return nil, fmt.Errorf("caughtup/feed: metrics: %w", err)
	}
	s.m = m
	switch {
	case cfg.Insecure && len(cfg.Keys.Keys) == 0:
		s.log.Warn("caughtup/feed: authentication OFF (Insecure: true, no keys): unsigned observations are believed; anyone who can publish on the channel can move this router",
			slog.String("channel", s.channel))
	case cfg.Insecure:
		s.log.Warn("caughtup/feed: accepting unsigned observations and unknown keys (Insecure: true) besides the configured keys; drop Insecure once every publisher signs",
			slog.String("channel", s.channel))
	}
	return s, nil
}

// Destination is the feed's pub/sub channel (ChannelName).
func (s *Subscriber) Destination() string { return s.channel }

// Health returns the state of Run's subscription (StateConnecting before
// Run).
func (s *Subscriber) Health() Health {
	s.mu.Lock()
	run := s.run
	s.mu.Unlock()
	if run == nil {
		return Health{State: StateConnecting}
	}
	return run.state()
}

// Run subscribes and delivers to the config's OnObservation and OnHealth
// until ctx ends, resubscribing with backoff whenever the subscription
// breaks; it returns nil then. It may be called once.
func (s *Subscriber) Run(ctx context.Context) error {
	if s.cfg.OnObservation == nil {
		return fmt.Errorf("%w: SubscriberConfig.OnObservation is required by Run", ErrInvalidConfig)
	}
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("caughtup/feed: Subscriber.Run called twice")
	}
	run := s.subscription(replay.FeedHandler{OnObservation: s.cfg.OnObservation, OnHealth: s.cfg.OnHealth})
	s.mu.Lock()
	s.run = run
	s.mu.Unlock()
	return run.loop(ctx)
}

// Subscribe is replay.FeedSource's: it delivers to h, as Run does to the
// config's callbacks, until ctx ends. Each call is a subscription of its
// own (its own Redis connection, health and replay memory); h's
// SilenceBound, when set, replaces the config's.
func (s *Subscriber) Subscribe(ctx context.Context, h replay.FeedHandler) error {
	if h.OnObservation == nil {
		return fmt.Errorf("%w: FeedHandler.OnObservation is required", ErrInvalidConfig)
	}
	if h.SilenceBound < 0 {
		return fmt.Errorf("%w: FeedHandler.SilenceBound must not be negative", ErrInvalidConfig)
	}
	return s.subscription(h).loop(ctx)
}

func (s *Subscriber) subscription(h replay.FeedHandler) *subscription {
	sub := &subscription{
		Subscriber:    s,
		onObservation: h.OnObservation,
		onHealth:      h.OnHealth,
		silence:       s.cfg.SilenceBound,
		health:        Health{State: StateConnecting, Since: time.Now()},
		macs:          newMACs(s.cfg.Feed, s.cfg.Keys.Keys),
		streams:       make(map[streamKey]*streamState),
		sharded:       shardedClient(s.cfg.Client),
	}
	if h.SilenceBound > 0 {
		sub.silence = h.SilenceBound
	}
	for i := range sub.warn {
		sub.warn[i] = rate.Sometimes{First: 3, Interval: 10 * time.Second}
	}
	return sub
}

func (s *subscription) state() Health {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.health
}

// loop runs sessions until ctx ends, with backoff between them.
func (s *subscription) loop(ctx context.Context) error {
	reg, err := s.cfg.MeterProvider.Meter(ScopeName).RegisterCallback(func(_ context.Context, o metric.Observer) error {
		cur := s.state().State
		for i := range numStates {
			var v int64
			if i == cur {
				v = 1
			}
			o.ObserveInt64(s.m.state, v, s.m.stateIs[i])
		}
		return nil
	}, s.m.state)
	if err != nil {
		return fmt.Errorf("caughtup/feed: metrics: %w", err)
	}
	defer func() { _ = reg.Unregister() }()
	defer s.setState(StateStopped, nil)

	// Jittered: a fleet's routers lose Redis together and must not all
	// come back at once.
	bo := retry.Jittered(s.cfg.MinBackoff, s.cfg.MaxBackoff)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		subscribed, err := s.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		// A Cluster's slot map may name a dead master; have it reloaded
		// before the next attempt.
		reloadSlots(ctx, s.cfg.Client)
		wait := bo.NextBackOff()
		if subscribed {
			s.setState(StateDropped, err)
			bo.Reset()
			wait = 0 // a dropped subscription is retried at once, then backs off
		} else {
			s.setState(StateUnreachable, err)
		}
		if wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				return nil
			case <-timer.C:
			}
		}
	}
}

// session subscribes, reads the stored values and streams until the
// subscription breaks; subscribed says whether it got that far.
func (s *subscription) session(ctx context.Context) (subscribed bool, err error) {
	var ps *redis.PubSub
	cmd := "subscribe"
	if s.sharded {
		ps, cmd = s.cfg.Client.SSubscribe(ctx), "ssubscribe"
	} else {
		ps = s.cfg.Client.Subscribe(ctx)
	}
	defer func() { _ = ps.Close() }()
	stop := context.AfterFunc(ctx, func() { _ = ps.Close() })
	defer stop()

	if s.sharded {
		err = ps.SSubscribe(ctx, s.channel)
	} else {
		err = ps.Subscribe(ctx, s.channel)
	}
	if err != nil {
		return false, fmt.Errorf("%s: %w", cmd, err)
	}
	msg, err := ps.ReceiveTimeout(ctx, s.cfg.ReadTimeout)
	if err != nil {
		if s.sharded && unknownCommand(err) {
			s.sharded = false
			s.log.Warn("caughtup/feed: this Redis Cluster does not know SSUBSCRIBE (Redis before 7.0); subscribing with classic SUBSCRIBE, as publishers detect alike",
				slog.String("channel", s.channel))
		}
		return false, fmt.Errorf("%s: %w", cmd, err)
	}
	if sub, ok := msg.(*redis.Subscription); !ok || sub.Kind != cmd {
		return false, fmt.Errorf("%s: unexpected reply %v", cmd, msg)
	}
	// Subscribed before reading the store: whatever is published from now
	// on arrives live, so nothing falls between the two.
	n, err := s.readStored(ctx)
	if err != nil {
		return false, fmt.Errorf("read stored values: %w", err)
	}
	s.setState(StateSubscribed, nil)
	s.log.Info("caughtup/feed: subscribed", slog.String("channel", s.channel), slog.Int("stored_values", n))

	tick := min(s.silence/4, s.cfg.PingInterval/2)
	tick = max(tick, time.Millisecond)
	lastAccepted := time.Now()
	lastRead := lastAccepted
	var pingSent time.Time
	for {
		msg, err := ps.ReceiveTimeout(ctx, tick)
		now := time.Now()
		// Checked after every read, not only when reads time out: a
		// steady stream of rejected messages must not hide the silence.
		if now.Sub(lastAccepted) > s.silence && s.state().State == StateSubscribed {
			s.setState(StateSilent, nil)
		}
		if err != nil {
			if ctx.Err() != nil {
				return true, ctx.Err()
			}
			if !isTimeout(err) {
				return true, err
			}
			switch {
			case pingSent.IsZero() && now.Sub(lastRead) >= s.cfg.PingInterval:
				if err := ps.Ping(ctx); err != nil {
					return true, fmt.Errorf("ping: %w", err)
				}
				pingSent = now
			case !pingSent.IsZero() && now.Sub(pingSent) > s.cfg.ReadTimeout:
				return true, fmt.Errorf("no answer to PING within %v", s.cfg.ReadTimeout)
			}
			continue
		}
		lastRead, pingSent = now, time.Time{}
		switch m := msg.(type) {
		case *redis.Message:
			if s.handle([]byte(m.Payload), now, false, 0) {
				lastAccepted = now
				if s.state().State == StateSilent {
					s.setState(StateSubscribed, nil)
				}
			}
		case *redis.Subscription:
			// sunsubscribe: the server no longer serves the channel's
			// slot (a failover demoted it, or the slot moved).
			if m.Kind == "unsubscribe" || m.Kind == "sunsubscribe" {
				return true, fmt.Errorf("unsubscribed by the server (%s)", m.Kind)
			}
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// readStored delivers the latest stored value of every publisher and
// node, each with its age measured by Redis. One MULTI per chunk reads a
// value and its PTTL together, so the age belongs to that value.
func (s *subscription) readStored(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReadTimeout)
	defer cancel()
	members, err := s.cfg.Client.SMembers(ctx, s.index).Result()
	if err != nil {
		return 0, err
	}
	// Only keys of this feed: with a hash tag they share a slot, so MULTI
	// works in a Cluster; anything else in the index is ignored.
	members = slices.DeleteFunc(members, func(k string) bool { return !strings.HasPrefix(k, s.valuePrefix) })
	slices.Sort(members)
	if len(members) > s.cfg.MaxStored {
		s.log.Warn("caughtup/feed: more stored values than MaxStored; reading the first",
			slog.Int("stored", len(members)), slog.Int("max_stored", s.cfg.MaxStored))
		members = members[:s.cfg.MaxStored]
	}
	delivered := 0
	for chunk := range slices.Chunk(members, 256) {
		pipe := s.cfg.Client.TxPipeline()
		gets := make([]*redis.StringCmd, len(chunk))
		pttls := make([]*redis.DurationCmd, len(chunk))
		for i, k := range chunk {
			gets[i] = pipe.Get(ctx, k)
			pttls[i] = pipe.PTTL(ctx, k)
		}
		if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
			return delivered, err
		}
		now := time.Now()
		for i := range chunk {
			v, err := gets[i].Bytes()
			if errors.Is(err, redis.Nil) {
				continue // expired since SMEMBERS
			}
			if err != nil {
				return delivered, err
			}
			if s.handle(v, now, true, pttls[i].Val()) {
				delivered++
			}
		}
	}
	return delivered, nil
}

// handle checks one message and delivers it when authentic and not
// superseded. pttl is the stored value's remaining expiry (stored only).
func (s *subscription) handle(b []byte, now time.Time, stored bool, pttl time.Duration) bool {
	m, err := parseMessage(b)
	if err != nil {
		reason := rejectMalformed
		if errors.Is(err, ErrUnsupportedVersion) {
			reason = rejectUnsupportedVersion
		}
		s.reject(reason, stored, nil, err)
		return false
	}
	if m.keyID == "" {
		if !s.cfg.Insecure {
			s.reject(rejectUnsigned, stored, &m, nil)
			return false
		}
	} else if ok, known := s.macs.Verify(m.keyID, m.signed, m.mac); !known {
		if !s.cfg.Insecure {
			s.reject(rejectUnknownKey, stored, &m, nil)
			return false
		}
		m.keyID = "" // believed, not verified
	} else if !ok {
		s.reject(rejectBadSignature, stored, &m, nil)
		return false
	}

	age := m.held
	if stored {
		// PTTL -1 (no expiry), -2 (gone) or above the TTL the publisher
		// signed: not stored by a publisher, and its age is unknowable.
		if m.ttl <= 0 || pttl < 0 || pttl > m.ttl {
			s.reject(rejectBadExpiry, stored, &m, fmt.Errorf("PTTL %v, signed TTL %v", pttl, m.ttl))
			return false
		}
		age += m.ttl - pttl
	}

	key := streamKey{publisher: m.publisher, instance: m.instance, database: m.obs.Database, node: m.obs.Node, role: m.obs.Role}
	st := s.streams[key]
	if st != nil && m.seq <= st.seq {
		// The overlap of a (re)subscription, not a replay: the same
		// message once from the store and once live, or a live message
		// published between SUBSCRIBE and the read of the store, older
		// than the value read and arriving after it, before any newer
		// live message of its stream.
		switch {
		case m.seq == st.seq && (stored || st.fromStore):
			st.fromStore = false
		case !stored && st.fromStore:
		default:
			s.reject(rejectReplayed, stored, &m, fmt.Errorf("sequence %d, already at %d", m.seq, st.seq))
			return false
		}
		s.m.duplicates.Add(context.Background(), 1, s.m.all)
		return false
	}
	if st == nil {
		s.evictStreams()
		st = &streamState{}
		s.streams[key] = st
	}
	st.seq, st.fromStore, st.heard = m.seq, stored, now

	d := Delivery{
		FeedObservation: m.obs,
		Publisher:       PublisherID{Name: m.publisher, Instance: m.instance},
		Seq:             m.seq,
		KeyID:           m.keyID,
		SentAt:          m.sentAt,
		ReceivedAt:      now,
		Stored:          stored,
		Age:             age,
		Held:            m.held,
	}
	d.PolledAt = now.Add(-age)
	if stored {
		s.m.received.Add(context.Background(), 1, s.m.stored)
	} else {
		s.m.received.Add(context.Background(), 1, s.m.live)
	}
	s.onObservation(d)
	return true
}

// evictStreams makes room for one more stream by forgetting the eighth
// heard from least recently.
func (s *subscription) evictStreams() {
	if len(s.streams) < s.cfg.MaxStreams {
		return
	}
	heard := make([]time.Time, 0, len(s.streams))
	for _, st := range s.streams {
		heard = append(heard, st.heard)
	}
	slices.SortFunc(heard, func(a, b time.Time) int { return a.Compare(b) })
	cut := heard[len(heard)/8]
	for k, st := range s.streams {
		if !st.heard.After(cut) {
			delete(s.streams, k)
		}
	}
}

func (s *subscription) reject(reason rejectReason, stored bool, m *message, detail error) {
	s.m.rejected.Add(context.Background(), 1, s.m.rejectedBy[reason])
	s.warn[reason].Do(func() {
		attrs := []any{slog.String("reason", reason.String()), slog.Bool("stored", stored)}
		if m != nil {
			attrs = append(attrs,
				slog.String("publisher", PublisherID{Name: m.publisher, Instance: m.instance}.String()),
				slog.String("key_id", m.keyID),
				slog.String("database", m.obs.Database), slog.String("node", m.obs.Node))
		}
		if detail != nil {
			attrs = append(attrs, slog.Any("error", detail))
		}
		s.log.Warn("caughtup/feed: rejected a message; it changes nothing (logged at most every 10s per reason; see caughtup.feed.rejected)", attrs...)
	})
}

func (s *subscription) setState(st State, err error) {
	s.mu.Lock()
	if s.health.State == st {
		s.mu.Unlock()
		return
	}
	prev := s.health.State
	s.health = Health{State: st, Since: time.Now(), Err: err}
	h := s.health
	s.mu.Unlock()
	s.m.transitions.Add(context.Background(), 1, s.m.stateIs[st])
	switch st {
	case StateSilent:
		s.log.Warn("caughtup/feed: feed silent; no authentic observation within the silence bound",
			slog.Duration("silence_bound", s.silence))
	case StateUnreachable:
		if prev != StateDropped {
			s.log.Warn("caughtup/feed: cannot subscribe; retrying with backoff", slog.Any("error", err))
		}
	case StateDropped:
		s.log.Warn("caughtup/feed: subscription dropped; resubscribing", slog.Any("error", err))
	}
	if s.onHealth != nil {
		s.onHealth(h)
	}
}
