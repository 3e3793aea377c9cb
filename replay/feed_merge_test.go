package replay

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/metrictest"
)

// The router's side of the feed without services: a tracker with pollers
// but no pools, a feed state whose source is never subscribed to, a clock
// the test moves, and deliveries made by hand as a FeedSource would hand
// them over (authentic, unsuperseded). Local polls are applied as the
// pollers would apply them.

// unsubscribed is a FeedSource nobody subscribes to: the rig calls the
// feed state's callbacks itself.
type unsubscribed struct{}

func (unsubscribed) Subscribe(context.Context, FeedHandler) error {
	panic("the rig does not subscribe")
}
func (unsubscribed) Destination() string { return "test" }

type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *testClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) advance(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
	return c.t
}

type feedRig struct {
	t      *testing.T
	tr     *Tracker
	f      *feedState
	clock  *testClock
	reader *sdkmetric.ManualReader
}

func newFeedRig(t *testing.T, replicas ...string) *feedRig {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	clock := &testClock{t: t0}
	cfg := TrackerConfig{
		MeterProvider: mp,
		Logger:        testLogger(t),
		Now:           clock.now,
		Feed:          &FeedConfig{Source: unsubscribed{}},
	}.WithDefaults()
	tr := &Tracker{cfg: &cfg, dbs: map[string]Database{"main": {}}, log: cfg.Logger, initDone: make(chan struct{})}
	tr.ctx, tr.cancel = context.WithCancel(context.Background())
	t.Cleanup(tr.cancel)
	ds := DatabaseState{Name: "main"}
	var rps []*replicaPoller
	for j, name := range replicas {
		ds.Replicas = append(ds.Replicas, ReplicaState{Name: name})
		rps = append(rps, &replicaPoller{db: 0, idx: j, dbName: "main", name: name, kick: make(chan struct{}, 1)})
	}
	tr.snap.Store(&Snapshot{Databases: []DatabaseState{ds}, changed: make(chan struct{})})
	tr.primarys = []*primaryPoller{{db: 0, dbName: "main", kick: make(chan struct{}, 1)}}
	tr.replicas = [][]*replicaPoller{rps}
	var err error
	tr.met, err = newTrackerMetrics(mp, tr)
	require.NoError(t, err)
	tr.feed, err = newFeedState(tr)
	require.NoError(t, err)
	t.Cleanup(tr.feed.close)
	return &feedRig{t: t, tr: tr, f: tr.feed, clock: clock, reader: reader}
}

var (
	inc1 = Incarnation{PostmasterStart: t0.Add(-time.Hour), RecoveryStart: t0.Add(-time.Hour)}
	inc2 = Incarnation{PostmasterStart: t0.Add(-time.Minute), RecoveryStart: t0.Add(-time.Minute)}
)

// polledPrimary applies the router's own poll of the primary.
func (r *feedRig) polledPrimary(insert string) {
	r.tr.applyPrimary(0, PrimaryObservation{ObservedAt: r.clock.now(), Epoch: ep(1), InsertLSN: lsn(insert),
		HistoryKnown: true, WAL: position.WALLayout{MaxAlign: 8, BlockSize: 8192, SegmentSize: 16 << 20}}, false)
}

// polledReplica applies the router's own poll of replica idx.
func (r *feedRig) polledReplica(idx int, inc Incarnation, at string) {
	now := r.clock.now()
	r.tr.applyReplica(r.tr.replicas[0][idx], ReplicaObservation{ObservedAt: now, ReadBy: now, Incarnation: inc,
		InRecovery: true, Replayed: position.Replayed{Epoch: ep(1), LSN: lsn(at)}, own: true})
}

// delivery is a feed message about a replica, received now, polled age
// ago by a publisher.
func (r *feedRig) replicaDelivery(node string, inc Incarnation, at string, age time.Duration) FeedDelivery {
	now := time.Now()
	return FeedDelivery{
		FeedObservation: FeedObservation{Database: "main", Node: node, Role: FeedRoleReplica, Replica: FeedReplicaStatus{
			InRecovery: true, Replayed: lsn(at), Epoch: ep(1),
			Incarnation: inc.PostmasterStart, RecoveryStart: inc.RecoveryStart}},
		Publisher:  PublisherID{Name: "pub-a", Instance: 1},
		SentAt:     now.Add(-age),
		ReceivedAt: now,
		Age:        age,
		Held:       age,
	}
}

func (r *feedRig) primaryDelivery(insert string, age time.Duration) FeedDelivery {
	now := time.Now()
	return FeedDelivery{
		FeedObservation: FeedObservation{Database: "main", Role: FeedRolePrimary, Primary: FeedPrimaryStatus{
			Epoch: ep(1), InsertLSN: lsn(insert), HistoryKnown: true}},
		Publisher:  PublisherID{Name: "pub-a", Instance: 1},
		SentAt:     now.Add(-age),
		ReceivedAt: now,
		Age:        age,
		Held:       age,
	}
}

func (r *feedRig) replica(idx int) ReplicaState { return r.tr.snapshot().Databases[0].Replicas[idx] }

// rejected is caughtup.consume.feed.observations.rejected for reason.
func (r *feedRig) rejected(reason string) int64 {
	r.t.Helper()
	return metrictest.Sum(r.t, r.reader, "caughtup.consume.feed.observations.rejected", attribute.String(attrReason, reason))
}

// routeTo is the first replica a job at LSN at (timeline 1) could be
// routed to, as consume.Decide judges a replica with spread 0 (usable,
// not held, not diverged, of the primary's epoch and past at), or "" for
// the primary.
func (r *feedRig) routeTo(at string) string {
	ds := r.tr.snapshot().Databases[0]
	cutoff := r.clock.now().Add(-r.tr.cfg.StalenessBound)
	for i := range ds.Replicas {
		rs := &ds.Replicas[i]
		if rs.Usable(cutoff) && !rs.Held() && !rs.Diverged && rs.Replayed.Epoch == ep(1) && rs.Replayed.LSN >= lsn(at) {
			return rs.Name
		}
	}
	return ""
}

func TestFeedBelievesOnlyConfirmedNodes(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1")
	// Before the router's own poll of the node: not believed.
	r.f.deliver(r.primaryDelivery("0/9000000", time.Millisecond))
	r.f.deliver(r.replicaDelivery("r1", inc1, "0/8000000", time.Millisecond))
	require.EqualValues(t, 2, r.rejected("unconfirmed"))
	require.Zero(t, r.replica(0).Observations)
	require.True(t, r.tr.snapshot().Databases[0].Primary.Epoch.IsZero())

	r.polledPrimary("0/9000000")
	r.polledReplica(0, inc1, "0/7000000")
	r.clock.advance(10 * time.Millisecond)
	r.f.deliver(r.replicaDelivery("r1", inc1, "0/8000000", time.Millisecond))
	got := r.replica(0)
	require.Equal(t, lsn("0/8000000"), got.Replayed.LSN)
	require.Equal(t, r.clock.now().Add(-time.Millisecond), got.ObservedAt, "stamped with the router's clock less the age")
	require.NotZero(t, r.f.replicas[0][0].fedAt.Load())
	require.Equal(t, "r1", r.routeTo("0/8000000"))

	// Lower positions of the same run do not lower it (max merge).
	r.f.deliver(r.replicaDelivery("r1", inc1, "0/7800000", time.Millisecond))
	require.Equal(t, lsn("0/8000000"), r.replica(0).Replayed.LSN)

	// An unknown node, an unknown database: ignored and counted.
	r.f.deliver(r.replicaDelivery("r9", inc1, "0/8000000", time.Millisecond))
	d := r.replicaDelivery("r1", inc1, "0/8000000", time.Millisecond)
	d.Database = "other"
	r.f.deliver(d)
	require.EqualValues(t, 2, r.rejected("unknown_node"))
}

func TestFeedOlderRunSuperseded(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1")
	r.polledPrimary("0/9000000")
	// The router's own poll sees the replica after a restart (inc2), low.
	r.polledReplica(0, inc2, "0/5000000")
	// An authentic message of the run before (late, or replayed by
	// someone who recorded it) claims more: superseded, never believed.
	r.f.deliver(r.replicaDelivery("r1", inc1, "0/8800000", time.Millisecond))
	require.EqualValues(t, 1, r.rejected("superseded"))
	require.Equal(t, lsn("0/5000000"), r.replica(0).Replayed.LSN)
	require.Empty(t, r.routeTo("0/8800000"))
	// A message without a run cannot show a restart.
	r.f.deliver(r.replicaDelivery("r1", Incarnation{}, "0/8800000", time.Millisecond))
	require.EqualValues(t, 1, r.rejected("no_incarnation"))
	// Another system under the same name.
	d := r.replicaDelivery("r1", inc2, "0/8800000", time.Millisecond)
	d.Replica.Epoch.SystemID++
	r.f.deliver(d)
	require.EqualValues(t, 1, r.rejected("mismatch"))
	require.Equal(t, lsn("0/5000000"), r.replica(0).Replayed.LSN)
}

func TestFeedRestartConfirmedByOwnPoll(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1")
	r.polledPrimary("0/9000000")
	r.polledReplica(0, inc1, "0/8000000")
	n := r.f.replicas[0][0]

	// The feed shows a newer run: the replica is unknown at once, and the
	// poller is woken to poll it.
	r.clock.advance(time.Millisecond)
	r.f.deliver(r.replicaDelivery("r1", inc2, "0/6000000", 0))
	require.ErrorIs(t, r.replica(0).Err, ErrUnconfirmedRestart)
	require.True(t, n.confirmWanted.Load())
	require.Len(t, n.kick, 1)
	require.Empty(t, r.routeTo("0/5000000"))

	// The router's poll sees the same run: the restart is merged (held
	// until it passes what it had), and the feed's observations of the
	// run are believed.
	r.clock.advance(time.Millisecond)
	r.polledReplica(0, inc2, "0/6000000")
	require.False(t, n.confirmWanted.Load())
	got := r.replica(0)
	require.NoError(t, got.Err)
	require.EqualValues(t, 1, got.Restarts)
	require.Equal(t, lsn("0/8000000"), got.RestartFloor)
	r.clock.advance(time.Millisecond)
	r.f.deliver(r.replicaDelivery("r1", inc2, "0/8100000", 0))
	require.Equal(t, lsn("0/8100000"), r.replica(0).Replayed.LSN)
	require.Zero(t, r.replica(0).RestartFloor, "released once past its old position")
	require.Equal(t, "r1", r.routeTo("0/8100000"))
}

// TestFeedLateOldRunKeepsTheClaim: after the feed shows a restart, a late
// message of the old run from a slower publisher (received later, so its
// time looks newer than the claim's) does not make the replica usable at
// its pre-restart position: only the router's own poll ends the claim.
func TestFeedLateOldRunKeepsTheClaim(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1")
	r.polledPrimary("0/9000000")
	r.polledReplica(0, inc1, "0/8000000")
	r.clock.advance(time.Millisecond)
	r.f.deliver(r.replicaDelivery("r1", inc2, "0/6000000", 0))
	require.ErrorIs(t, r.replica(0).Err, ErrUnconfirmedRestart)

	r.clock.advance(300 * time.Millisecond)
	late := r.replicaDelivery("r1", inc1, "0/8000000", 0)
	late.Publisher.Name = "pub-slow"
	r.f.deliver(late)
	require.ErrorIs(t, r.replica(0).Err, ErrUnconfirmedRestart, "a late message of the old run ended the restart claim")
	require.Empty(t, r.routeTo("0/7000000"), "routed at the pre-restart position")

	r.clock.advance(time.Millisecond)
	r.polledReplica(0, inc2, "0/6000000")
	require.NoError(t, r.replica(0).Err)
}

func TestFeedNameMismatchNotBelieved(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1")
	r.polledPrimary("0/9000000")
	r.polledReplica(0, inc1, "0/5000000")
	n := r.f.replicas[0][0]
	// The publisher calls another server "r1": a newer run than this
	// router's r1 and further ahead.
	r.clock.advance(time.Millisecond)
	r.f.deliver(r.replicaDelivery("r1", inc2, "0/8800000", 0))
	require.True(t, n.confirmWanted.Load())
	// A poll sent before that message arrived proves nothing.
	stale := ReplicaObservation{ObservedAt: r.clock.now().Add(-time.Second), ReadBy: r.clock.now(), Incarnation: inc1,
		InRecovery: true, Replayed: position.Replayed{Epoch: ep(1), LSN: lsn("0/5000000")}}
	r.tr.applyReplica(r.tr.replicas[0][0], stale)
	require.True(t, n.confirmWanted.Load())
	// The next one contradicts it: mismatch, and the feed's observations
	// of that run are ignored from now on.
	r.clock.advance(time.Millisecond)
	r.polledReplica(0, inc1, "0/5000000")
	require.False(t, n.confirmWanted.Load())
	require.EqualValues(t, 1, r.rejected("mismatch"))
	r.clock.advance(time.Millisecond)
	r.f.deliver(r.replicaDelivery("r1", inc2, "0/8800000", 0))
	require.EqualValues(t, 2, r.rejected("mismatch"))
	require.False(t, n.confirmWanted.Load())
	got := r.replica(0)
	require.NoError(t, got.Err)
	require.Equal(t, lsn("0/5000000"), got.Replayed.LSN)
	require.Empty(t, r.routeTo("0/8800000"), "never routed on the other server's position")
}

func TestFeedImpossibleHeldThenUnknown(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1", "r2")
	r.polledPrimary("0/9000000")
	r.polledReplica(0, inc1, "0/8000000")
	r.polledReplica(1, inc1, "0/8000000")

	// r1 claims far more than the primary is known to have inserted: held,
	// not merged; routing is unchanged.
	r.clock.advance(time.Millisecond)
	r.f.deliver(r.replicaDelivery("r1", inc1, "FF/FFFFFF00", 0))
	// r2 claims a little more than that: possible, the primary may have
	// moved on. Also held until a primary observation shows it.
	r.f.deliver(r.replicaDelivery("r2", inc1, "0/9100000", 0))
	require.Equal(t, lsn("0/8000000"), r.replica(0).Replayed.LSN)
	require.Equal(t, lsn("0/8000000"), r.replica(1).Replayed.LSN)
	require.Empty(t, r.routeTo("0/9100000"))
	require.Len(t, r.f.replicas[0][0].pending, 1)

	// A primary observation made before those claims were received settles
	// only what it shows possible.
	early := r.primaryDelivery("0/9200000", 10*time.Millisecond)
	r.f.deliver(early)
	require.Equal(t, lsn("0/9100000"), r.replica(1).Replayed.LSN)
	require.Equal(t, "r2", r.routeTo("0/9100000"))
	require.Len(t, r.f.replicas[0][0].pending, 1, "an earlier primary read proves nothing against r1")
	require.NoError(t, r.replica(0).Err)

	// One made after them shows r1's impossible: r1 is unknown.
	r.clock.advance(time.Millisecond)
	r.polledPrimary("0/9300000")
	require.Empty(t, r.f.replicas[0][0].pending)
	require.ErrorIs(t, r.replica(0).Err, ErrImpossibleObservation)
	require.NotEqual(t, "r1", r.routeTo("0/8000000"))
	require.EqualValues(t, 1, metrictest.Sum(t, r.reader, "caughtup.consume.tracker.observations.rejected",
		attribute.String(attrReason, rejectedImpossible)))

	// A later possible observation makes it usable again.
	r.clock.advance(time.Millisecond)
	r.f.deliver(r.replicaDelivery("r1", inc1, "0/9300000", 0))
	require.NoError(t, r.replica(0).Err)
	require.Equal(t, "r1", r.routeTo("0/9300000"))
}

func TestFeedHeldUntilPrimaryKnownAndExpires(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1")
	r.polledReplica(0, inc1, "0/1000000")
	// No primary known: nothing a publisher says raises the replica.
	r.f.deliver(r.replicaDelivery("r1", inc1, "0/2000000", 0))
	require.Equal(t, lsn("0/1000000"), r.replica(0).Replayed.LSN)
	require.Len(t, r.f.replicas[0][0].pending, 1)
	// Still unconfirmed by the time a primary appears: dropped, counted.
	r.clock.advance(2 * r.tr.cfg.StalenessBound)
	r.polledPrimary("0/1800000")
	require.Empty(t, r.f.replicas[0][0].pending)
	require.EqualValues(t, 1, r.rejected("unverified"))
	require.Equal(t, lsn("0/1000000"), r.replica(0).Replayed.LSN)
	// Overflow drops the oldest.
	for range maxPending + 2 {
		r.f.deliver(r.replicaDelivery("r1", inc1, "0/2000000", 0))
	}
	require.Len(t, r.f.replicas[0][0].pending, maxPending)
	require.EqualValues(t, 3, r.rejected("unverified"))
}

func TestFeedDelayedRefused(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1")
	r.polledPrimary("0/9000000")
	r.polledReplica(0, inc1, "0/1000000")
	// Sent long ago by the publisher's clock, though it looks fresh (a
	// replay, or a publisher stalled between polling and sending).
	d := r.replicaDelivery("r1", inc1, "0/2000000", 0)
	d.SentAt = d.ReceivedAt.Add(-time.Minute)
	r.f.deliver(d)
	require.EqualValues(t, 1, r.rejected("delayed"))
	require.Equal(t, lsn("0/1000000"), r.replica(0).Replayed.LSN)
	// Time spent stored in Redis, which the feed measured, is not delay.
	d = r.replicaDelivery("r1", inc1, "0/2000000", 0)
	d.SentAt, d.Age, d.Stored = d.ReceivedAt.Add(-8*time.Second), 8*time.Second, true
	r.f.deliver(d)
	require.EqualValues(t, 1, r.rejected("delayed"))
	got := r.replica(0)
	require.Equal(t, lsn("0/2000000"), got.Replayed.LSN)
	// ... but its age counts: the position is believed, the freshness is
	// the poll's (older than the router's own poll, which stays newest).
	require.Equal(t, t0, got.ObservedAt)
}

func TestFeedPollErrorMakesUnknown(t *testing.T) {
	t.Parallel()
	r := newFeedRig(t, "r1")
	r.polledPrimary("0/9000000")
	r.polledReplica(0, inc1, "0/8000000")
	r.clock.advance(time.Millisecond)
	d := r.replicaDelivery("r1", Incarnation{}, "0/0", 0)
	d.Err, d.Replica = "connection refused", FeedReplicaStatus{}
	r.f.deliver(d)
	var fe *FeedPollError
	require.ErrorAs(t, r.replica(0).Err, &fe)
	require.Equal(t, "connection refused", fe.Text)
	require.Empty(t, r.routeTo("0/8000000"))
}
