package lab

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
)

// forgedFeedScenario (issue 16): while replay is paused on both replicas,
// messages claiming that both replicas have replayed FFFFFFFF/FFFFFFFF
// are published on the router's feed channel with a plain Redis client,
// as anyone who can reach the Redis could: signed with a wrong secret,
// with a key the routers do not hold, for another feed, unsigned,
// malformed, of an unknown format version, authentic messages recorded
// earlier and sent again, and, as a holder of the key could (a
// compromised publisher), authentic ones that are impossible (ahead of the
// primary), of an earlier run of the replica, sent long ago, of a node or
// a system the router does not have. Jobs flow meanwhile; a router that
// believed one claim would send them to a paused replica that lacks their
// rows. Checks: every injected message is counted as rejected, under the
// reason its kind calls for, and no more; 0 stale, 0 lost.
func forgedFeedScenario(sl scale) *scenario {
	pause := forgedPause(sl)
	return feedScenario(&scenario{
		name: "forged-feed",
		about: fmt.Sprintf("router on a signed feed of 2 publisher processes; replay paused on both replicas for %s, during which %d forged "+
			"messages claiming both replicas caught up (%d kinds) are published with a plain Redis client", pause, forgedPerKind(sl)*len(forgeKinds), len(forgeKinds)),
		policy: consume.Delayed,
		span:   func(s scale) time.Duration { return s.span(s.lead + forgedPause(s) + s.tail) },
		fault:  forgedFeed,
		check:  checkForged,
	})
}

// forgedPause is the replay pause during which the forgeries arrive: at
// least 10s in the full run.
func forgedPause(sl scale) time.Duration {
	if sl.jobs < fullScale.jobs {
		return 4 * time.Second
	}
	return 15 * time.Second
}

// forgedPerKind is how many messages of each kind are injected: 100 in the
// full run (1,200 in all), 20 in the short one.
func forgedPerKind(sl scale) int {
	if sl.jobs < fullScale.jobs {
		return 20
	}
	return 100
}

// forgeKind is one kind of forged message and the counter that must
// reject it: "feed/<reason>" (caughtup.feed.rejected: the feed package
// refused the message), "router/<reason>"
// (caughtup.consume.feed.observations.rejected: authentic, not believed)
// or "impossible" (held until a primary observation, then found impossible
// or dropped unverified: caughtup.consume.tracker.observations.rejected
// impossible plus caughtup.consume.feed.observations.rejected unverified).
type forgeKind struct {
	name    string
	counter string
	make    func(fc *forgeContext, i int) []byte
}

var forgeKinds = []forgeKind{
	{"wrong secret", "feed/bad_signature", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-secret", i)
		m.secret = fc.wrongSecret
		return m.encode()
	}},
	{"another feed's MAC", "feed/bad_signature", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-feed", i)
		m.macFeed = fc.feed + "-other"
		return m.encode()
	}},
	{"unknown key ID", "feed/unknown_key", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-keyid", i)
		m.keyID = "chaos9"
		return m.encode()
	}},
	{"unsigned", "feed/unsigned", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-unsigned", i)
		m.keyID, m.secret = "", nil
		return m.encode()
	}},
	{"malformed", "feed/malformed", func(fc *forgeContext, i int) []byte {
		if i%2 == 0 {
			return append([]byte{1}, fmt.Sprintf("replica%d replayed FFFFFFFF/FFFFFFFF", i%2+1)...)
		}
		b := fc.claim("forger-truncated", i).encode()
		return b[:len(b)-1] // a signed claim one byte short
	}},
	{"format version 2", "feed/unsupported_version", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-v2", i)
		m.version = 2
		return m.encode()
	}},
	{"authentic, replayed", "feed/replayed", func(fc *forgeContext, i int) []byte {
		return fc.recorded[i%len(fc.recorded)]
	}},
	{"authentic, impossible", "impossible", func(fc *forgeContext, i int) []byte {
		return fc.claim("forger-impossible", i).encode()
	}},
	{"authentic, earlier run", "router/superseded", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-oldrun", i)
		m.incarnation = m.incarnation.Add(-time.Hour)
		return m.encode()
	}},
	{"authentic, sent a minute ago", "router/delayed", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-delayed", i)
		m.sentAt = time.Now().Add(-time.Minute)
		return m.encode()
	}},
	{"authentic, unknown node", "router/unknown_node", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-node", i)
		m.node = "replica9"
		return m.encode()
	}},
	{"authentic, another system", "router/mismatch", func(fc *forgeContext, i int) []byte {
		m := fc.claim("forger-system", i)
		m.system++
		return m.encode()
	}},
}

// forgeContext is what the forger knows: the feed's name and channel, the
// key (for the kinds a key holder sends), the replicas' names, runs and
// epoch, and authentic messages it recorded.
type forgeContext struct {
	feed        string
	key         feed.Key
	wrongSecret []byte
	replicas    []replay.ReplicaState
	epoch       replay.PrimaryState
	recorded    [][]byte
	instances   map[string]uint64
	seqs        map[string]uint64
}

// claim is an authentic-looking observation that replica i%2+1 has
// replayed FFFFFFFF/FFFFFFFF, in its current run and the primary's epoch,
// signed with the feed's key, from publisher name.
func (fc *forgeContext) claim(name string, i int) *forgery {
	if fc.instances[name] == 0 {
		var b [8]byte
		_, _ = rand.Read(b[:])
		fc.instances[name] = binary.BigEndian.Uint64(b[:]) | 1
	}
	fc.seqs[name]++
	rs := fc.replicas[i%len(fc.replicas)]
	return &forgery{
		version: 1, keyID: fc.key.ID, secret: fc.key.Secret, macFeed: fc.feed,
		publisher: name, instance: fc.instances[name], seq: fc.seqs[name],
		sentAt: time.Now(), ttl: 10 * time.Second,
		database: "main", node: rs.Name,
		replay: 0xFFFFFFFF_FFFFFFFF, system: fc.epoch.Epoch.SystemID, timeline: fc.epoch.Epoch.Timeline,
		incarnation: rs.Incarnation.PostmasterStart, recoveryStart: rs.Incarnation.RecoveryStart,
	}
}

// forgery is one replica observation message as an attacker writes it,
// from the wire format in the feed package's documentation ("Wire format",
// "Authentication") rather than with the package's encoder: the forger
// has the document, and the authentic kinds being rejected for the right
// reason (not as malformed or wrongly signed) shows the document is exact.
type forgery struct {
	version                    byte
	keyID                      string
	secret                     []byte // nil: no signature
	macFeed                    string // the feed name the MAC covers
	publisher                  string
	instance, seq              uint64
	sentAt                     time.Time
	ttl, held                  time.Duration
	database, node             string
	replay, system             uint64
	timeline                   uint32
	incarnation, recoveryStart time.Time
}

func (f *forgery) encode() []byte {
	str8 := func(b []byte, s string) []byte { return append(append(b, byte(len(s))), s...) }
	b := []byte{f.version}
	b = str8(b, f.keyID)
	b = str8(b, f.publisher)
	b = binary.BigEndian.AppendUint64(b, f.instance)
	b = binary.AppendUvarint(b, f.seq)
	b = binary.AppendVarint(b, f.sentAt.UnixMicro())
	b = binary.AppendUvarint(b, uint64(f.ttl/time.Millisecond))
	b = binary.AppendUvarint(b, uint64(f.held/time.Microsecond))
	b = str8(b, f.database)
	b = str8(b, f.node)
	b = append(b, 2)               // role: replica
	b = binary.AppendUvarint(b, 0) // no error text
	flags := byte(1)               // in recovery
	if !f.incarnation.IsZero() {
		flags |= 1 << 2
		if !f.recoveryStart.IsZero() {
			flags |= 1 << 3
		}
	}
	b = append(b, flags)
	b = binary.AppendUvarint(b, f.replay)
	b = binary.BigEndian.AppendUint64(b, f.system)
	b = binary.AppendUvarint(b, uint64(f.timeline))
	b = binary.AppendUvarint(b, 0) // time lag
	if flags&(1<<2) != 0 {
		b = binary.AppendVarint(b, f.incarnation.UnixMicro())
	}
	if flags&(1<<3) != 0 {
		b = binary.AppendVarint(b, f.recoveryStart.UnixMicro())
	}
	if f.keyID != "" && f.secret != nil {
		mac := hmac.New(sha256.New, f.secret)
		mac.Write([]byte("caughtup/feed/v1\x00" + f.macFeed + "\x00"))
		mac.Write(b)
		b = mac.Sum(b)
	}
	return b
}

// forgedState is what forged-feed injected and what was rejected, by
// counter.
type forgedState struct {
	injected map[string]int
	rejected map[string]int64
	kinds    []string
	// from and to bound the injection; resumed is when replay resumed.
	from, to, resumed time.Time
}

// rejections reads every counter a forged message can land in, as
// forgeKind.counter names them.
func rejections(r *run) map[string]int64 {
	out := map[string]int64{}
	for reason, n := range r.metrics.sum("caughtup.feed.rejected", "caughtup.reason") {
		out["feed/"+reason] += n
	}
	for reason, n := range r.metrics.sum("caughtup.consume.feed.observations.rejected", "caughtup.reason") {
		if reason == "unverified" {
			out["impossible"] += n
			continue
		}
		out["router/"+reason] += n
	}
	out["impossible"] += r.metrics.sum("caughtup.consume.tracker.observations.rejected", "caughtup.reason")["impossible"]
	return out
}

func delta(now, before map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for k, v := range now {
		if d := v - before[k]; d != 0 {
			out[k] = d
		}
	}
	return out
}

func sumCounts[V int | int64](m map[string]V) int64 {
	var n int64
	for _, v := range m {
		n += int64(v)
	}
	return n
}

func forgedFeed(ctx context.Context, r *run) error {
	f := feedOf(r)
	attacker := redis.NewClient(&redis.Options{Addr: r.s.redis.Addr()})
	defer attacker.Close()
	channel := feed.ChannelName(f.name)

	// Authentic messages, recorded from the channel as anyone subscribed
	// to it can, to send again later.
	per := forgedPerKind(r.sl)
	spy := attacker.Subscribe(ctx, channel)
	var recorded [][]byte
	for len(recorded) < per {
		m, err := spy.ReceiveMessage(ctx)
		if err != nil {
			_ = spy.Close()
			return fmt.Errorf("recording authentic messages: %w", err)
		}
		recorded = append(recorded, []byte(m.Payload))
	}
	_ = spy.Close()

	if err := r.at(ctx, r.sl.lead); err != nil {
		return err
	}
	nodes := r.cluster.Replicas()
	defer resumeAll(nodes)
	if err := pauseAll(ctx, nodes); err != nil {
		return err
	}
	paused := time.Now()
	pause := forgedPause(r.sl)
	r.event("paused replay on %s for %s; recorded %d authentic messages", names(nodes), pause, len(recorded))

	wrong := make([]byte, feed.MinSecretLen)
	_, _ = rand.Read(wrong)
	db := r.env.router.Snapshot().Database("main")
	fc := &forgeContext{feed: f.name, key: f.keys.Keys[0], wrongSecret: wrong, replicas: db.Replicas, epoch: db.Primary,
		recorded: recorded, instances: map[string]uint64{}, seqs: map[string]uint64{}}

	// Every kind interleaved, spread over a third of the pause (after a
	// moment, so that the jobs written since the pause are waiting), each
	// made just before it is sent: its send time is part of it.
	type next struct {
		kind forgeKind
		i    int
	}
	var msgs []next
	st := &forgedState{injected: map[string]int{}}
	for i := range per {
		for _, k := range forgeKinds {
			msgs = append(msgs, next{k, i})
			st.injected[k.counter]++
		}
	}
	for _, k := range forgeKinds {
		st.kinds = append(st.kinds, fmt.Sprintf("%s (%s)", k.name, k.counter))
	}
	if !sleepCtx(ctx, pause/10) {
		return ctx.Err()
	}
	before := rejections(r)
	st.from = time.Now()
	step := pause / 3 / time.Duration(len(msgs))
	for i, m := range msgs {
		if err := attacker.Publish(ctx, channel, m.kind.make(fc, m.i)).Err(); err != nil {
			return fmt.Errorf("publishing forged message %d: %w", i, err)
		}
		if d := time.Until(st.from.Add(time.Duration(i+1) * step)); d > 0 {
			sleepCtx(ctx, d)
		}
	}
	st.to = time.Now()
	r.event("published %d forged messages in %s with a plain Redis client", len(msgs), st.to.Sub(st.from).Round(time.Millisecond))
	want := sumCounts(st.injected)
	// Held "impossible" claims are settled by the next primary
	// observations; the rest are counted as they arrive.
	waitFor(ctx, time.Until(paused.Add(pause-500*time.Millisecond)), func() bool {
		return sumCounts(delta(rejections(r), before)) >= want
	})
	st.rejected = delta(rejections(r), before)
	r.event("rejected since the first forgery: %d of %d (%s)", sumCounts(st.rejected), want, sortedCounts(st.rejected))
	f.mu.Lock()
	f.forged = st
	f.mu.Unlock()

	if err := r.at(ctx, r.sl.lead+pause); err != nil {
		return err
	}
	// Jobs may read a replica as soon as the first resume takes effect.
	f.mu.Lock()
	st.resumed = time.Now()
	f.mu.Unlock()
	if err := resumeAll(nodes); err != nil {
		return err
	}
	r.event("resumed replay on %s after %s", names(nodes), time.Since(paused).Round(100*time.Millisecond))
	return nil
}

func checkForged(r *run, res *scenarioResult) {
	f := feedOf(r)
	if f == nil {
		return
	}
	f.mu.Lock()
	st := f.forged
	f.mu.Unlock()
	if st == nil {
		return // the fault failed and said so
	}
	injected, rejected := sumCounts(st.injected), sumCounts(st.rejected)
	keys := slices.Sorted(maps.Keys(st.injected))
	var rows []string
	for _, k := range keys {
		rows = append(rows, fmt.Sprintf("%s %d/%d", k, st.rejected[k], st.injected[k]))
		if int64(st.injected[k]) != st.rejected[k] {
			r.fail("%s: %d messages injected, %d rejected", k, st.injected[k], st.rejected[k])
		}
	}
	for k, n := range st.rejected {
		if _, ok := st.injected[k]; !ok {
			r.fail("%d rejections under %s, where no forged message was meant to land", n, k)
		}
	}
	r.note("forged messages: %d injected, %d rejected (rejected/injected by counter: %s); kinds: %s",
		injected, rejected, strings.Join(rows, ", "), strings.Join(st.kinds, "; "))
	if injected != rejected {
		r.fail("%d forged messages injected, %d rejected", injected, rejected)
	}
	// The claims had teeth: jobs written while they arrived needed a
	// replica past the paused position; one that believed a claim would
	// have read a paused replica before replay resumed.
	var jobs, early, replica int
	for _, s := range r.streams() {
		s.mu.Lock()
		for _, rd := range s.reads {
			if c := time.Unix(0, rd.job.Committed); c.Before(st.from) || c.After(st.to) {
				continue
			}
			jobs++
			if rd.at.Before(st.resumed) {
				early++
				if rd.replica != "" {
					replica++
				}
			}
		}
		s.mu.Unlock()
	}
	r.note("%d reads of jobs written while the forgeries arrived: %d before replay resumed, %d of those on a replica", jobs, early, replica)
	if replica > 0 {
		r.fail("%d jobs written during the pause read a replica before replay resumed", replica)
	}
	res.Forged = &forgedResult{Injected: int(injected), Rejected: int(rejected), ByCounter: st.injected, RejectedByCounter: st.rejected}
}

// forgedResult is forged-feed's count, by the counter each kind of
// message must land in (see forgeKind).
type forgedResult struct {
	Injected          int              `json:"injected"`
	Rejected          int              `json:"rejected"`
	ByCounter         map[string]int   `json:"injected_by_counter"`
	RejectedByCounter map[string]int64 `json:"rejected_by_counter"`
}
