package replay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
)

func TestPublishDue(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1_700_000_000, 0)
	inc := t0.Add(-time.Hour)
	replica := FeedObservation{Database: "main", Node: "r1", Role: FeedRoleReplica, PolledAt: t0,
		Replica: FeedReplicaStatus{InRecovery: true, Replayed: 100, Epoch: position.Epoch{SystemID: 7, Timeline: 1},
			ReplayTimestamp: t0.Add(-time.Second), TimeLag: time.Second, Incarnation: inc, RecoveryStart: inc.Add(time.Second)}}
	primary := FeedObservation{Database: "main", Role: FeedRolePrimary, PolledAt: t0,
		Primary: FeedPrimaryStatus{Epoch: position.Epoch{SystemID: 7, Timeline: 2}, InsertLSN: 200, HistoryKnown: true,
			History: position.History{{Timeline: 1, Switchpoint: 50}}}}
	const hb = 100 * time.Millisecond
	sent := func(o FeedObservation) sentObservation { return sentObservation{obs: o, at: t0} }
	with := func(o FeedObservation, f func(*FeedObservation)) FeedObservation {
		o.Primary.History = append(position.History(nil), o.Primary.History...)
		f(&o)
		return o
	}
	for _, tc := range []struct {
		name      string
		prev      FeedObservation
		nothing   bool // nothing sent yet
		o         FeedObservation
		after     time.Duration
		heartbeat time.Duration
		due       bool
	}{
		{name: "first observation of the node", nothing: true, o: replica, due: true},
		{name: "unchanged before the heartbeat", prev: replica, o: replica, after: hb - time.Millisecond},
		{name: "unchanged at the heartbeat", prev: replica, o: replica, after: hb, due: true},
		{name: "negative heartbeat: every poll", prev: replica, o: replica, heartbeat: -1, due: true},
		{name: "only poll time, replay timestamp and time lag moved", prev: replica, o: with(replica, func(o *FeedObservation) {
			o.PolledAt = o.PolledAt.Add(10 * time.Millisecond)
			o.Replica.TimeLag += 10 * time.Millisecond
			o.Replica.ReplayTimestamp = o.Replica.ReplayTimestamp.Add(time.Millisecond)
		}), after: time.Millisecond},
		{name: "replay moved", prev: replica, o: with(replica, func(o *FeedObservation) { o.Replica.Replayed++ }), due: true},
		{name: "timeline moved", prev: replica, o: with(replica, func(o *FeedObservation) { o.Replica.Epoch.Timeline = 2 }), due: true},
		{name: "left recovery", prev: replica, o: with(replica, func(o *FeedObservation) { o.Replica.InRecovery = false }), due: true},
		{name: "restarted", prev: replica, o: with(replica, func(o *FeedObservation) { o.Replica.Incarnation = t0 }), due: true},
		{name: "replay restarted", prev: replica, o: with(replica, func(o *FeedObservation) { o.Replica.RecoveryStart = t0 }), due: true},
		{name: "poll failed", prev: replica, o: FeedObservation{Database: "main", Node: "r1", Role: FeedRoleReplica, Err: "timeout"}, due: true},
		{name: "same failure again", prev: FeedObservation{Role: FeedRoleReplica, Err: "timeout"},
			o: FeedObservation{Role: FeedRoleReplica, Err: "timeout"}, after: time.Millisecond},
		{name: "another failure", prev: FeedObservation{Role: FeedRoleReplica, Err: "timeout"},
			o: FeedObservation{Role: FeedRoleReplica, Err: "refused"}, due: true},
		{name: "primary unchanged", prev: primary, o: with(primary, func(o *FeedObservation) { o.PolledAt = o.PolledAt.Add(time.Second) }), after: time.Millisecond},
		{name: "primary inserted", prev: primary, o: with(primary, func(o *FeedObservation) { o.Primary.InsertLSN++ }), due: true},
		{name: "primary promoted", prev: primary, o: with(primary, func(o *FeedObservation) { o.Primary.Epoch.Timeline = 3 }), due: true},
		{name: "primary history learned", prev: with(primary, func(o *FeedObservation) { o.Primary.History, o.Primary.HistoryKnown = nil, false }),
			o: primary, due: true},
		{name: "primary history grew", prev: primary, o: with(primary, func(o *FeedObservation) {
			o.Primary.History = append(o.Primary.History, position.TimelineSwitch{Timeline: 2, Switchpoint: 150})
		}), due: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hb := hb
			if tc.heartbeat != 0 {
				hb = tc.heartbeat
			}
			require.Equal(t, tc.due, publishDue(sent(tc.prev), !tc.nothing, &tc.o, t0.Add(tc.after), hb))
		})
	}
}
