package replay

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/position"
)

// Observations for the merge tests: at(ms) is t0 plus ms milliseconds.
func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

func inc(pm, rec int) Incarnation {
	return Incarnation{PostmasterStart: at(-100000 + pm), RecoveryStart: at(-100000 + rec)}
}

// replayedAt is a replay position on timeline tli.
func replayedAt(tli uint32, at string) position.Replayed {
	return position.Replayed{Epoch: ep(tli), LSN: lsn(at)}
}

func robs(ms int, i Incarnation, tli uint32, lsnText string) ReplicaObservation {
	return ReplicaObservation{ObservedAt: at(ms), Incarnation: i, InRecovery: true,
		Replayed: replayedAt(tli, lsnText)}
}

func pobs(ms int, tli uint32, insert string, hist position.History) PrimaryObservation {
	return PrimaryObservation{ObservedAt: at(ms), Epoch: ep(tli), InsertLSN: lsn(insert),
		History: hist, HistoryKnown: tli == 1 || hist != nil}
}

func foldReplica(p *PrimaryState, obs ...ReplicaObservation) (ReplicaState, []replicaChange) {
	cfg := TrackerConfig{MaxLagBytes: 1 << 40}.WithDefaults()
	r := ReplicaState{Name: "r1"}
	var chs []replicaChange
	for _, o := range obs {
		var ch replicaChange
		r, ch = mergeReplica(r, o, p, &cfg)
		chs = append(chs, ch)
	}
	return r, chs
}

func primaryAt(ms int, tli uint32, insert string, hist position.History) *PrimaryState {
	p, _ := mergePrimary(PrimaryState{}, pobs(ms, tli, insert, hist))
	return &p
}

func TestMergeReplica(t *testing.T) {
	t.Parallel()
	i1, i2 := inc(0, 1), inc(5000, 5001)
	crash := inc(0, 3000) // the postmaster survived, the startup process restarted
	p := primaryAt(-1000, 1, "0/9000000", nil)
	down := errors.New("connection refused")
	hist := position.History{{Timeline: 1, Switchpoint: lsn("0/5000000")}}

	cases := []struct {
		name    string
		p       *PrimaryState
		obs     []ReplicaObservation
		replay  position.Replayed // want
		err     error
		fresh   time.Time // want ObservedAt
		usable  bool
		floor   position.LSN
		highest position.LSN
		div     bool
		changes replicaChange // OR of all changes
	}{
		{
			name:   "in order, position grows",
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/1000000"), robs(10, i1, 1, "0/2000000")},
			replay: replayedAt(1, "0/2000000"), fresh: at(10), usable: true,
			highest: lsn("0/2000000"),
		},
		{
			name:   "out of order within one incarnation: max position, newest freshness",
			obs:    []ReplicaObservation{robs(10, i1, 1, "0/2000000"), robs(0, i1, 1, "0/1000000")},
			replay: replayedAt(1, "0/2000000"), fresh: at(10), usable: true,
			highest: lsn("0/2000000"),
		},
		{
			name:   "a newer timeline wins, in whatever order",
			p:      primaryAt(-1000, 2, "0/9000000", hist),
			obs:    []ReplicaObservation{robs(10, i1, 2, "0/4900000"), robs(0, i1, 1, "0/4800000")},
			replay: replayedAt(2, "0/4900000"), fresh: at(10), usable: true,
			highest: lsn("0/4900000"),
		},
		{
			name:   "restart: the lower position of the newer incarnation replaces the state, held below the old highest",
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/3000000"), robs(10, i2, 1, "0/2000000")},
			replay: replayedAt(1, "0/2000000"), fresh: at(10), usable: true,
			floor: lsn("0/3000000"), highest: lsn("0/3000000"),
			changes: replicaChange{restarted: true},
		},
		{
			name:   "crash restart with the postmaster surviving is a restart too",
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/3000000"), robs(10, crash, 1, "0/2000000")},
			replay: replayedAt(1, "0/2000000"), fresh: at(10), usable: true,
			floor: lsn("0/3000000"), highest: lsn("0/3000000"),
			changes: replicaChange{restarted: true},
		},
		{
			name: "after a restart nothing of the older incarnation is merged, whenever it arrives",
			obs: []ReplicaObservation{robs(10, i2, 1, "0/2000000"), robs(20, i1, 1, "0/3000000"),
				robs(30, i1, 1, "0/3800000")},
			replay: replayedAt(1, "0/2000000"), fresh: at(10), usable: true,
			highest: lsn("0/2000000"), changes: replicaChange{superseded: true},
		},
		{
			name:   "the hold ends once the restarted replica passes its old highest",
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/3000000"), robs(10, i2, 1, "0/2000000"), robs(20, i2, 1, "0/3000000")},
			replay: replayedAt(1, "0/3000000"), fresh: at(20), usable: true,
			highest: lsn("0/3000000"), changes: replicaChange{restarted: true, released: true},
		},
		{
			name: "a newer error makes the replica unknown; an older success does not undo it",
			obs: []ReplicaObservation{robs(0, i1, 1, "0/1000000"), {ObservedAt: at(20), Err: down},
				robs(10, i1, 1, "0/2000000")},
			replay: replayedAt(1, "0/2000000"), err: down, fresh: at(10),
			highest: lsn("0/1000000"), changes: replicaChange{failed: true},
		},
		{
			name:   "a newer success clears an error",
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/1000000"), {ObservedAt: at(10), Err: down}, robs(20, i1, 1, "0/1000000")},
			replay: replayedAt(1, "0/1000000"), fresh: at(20), usable: true,
			highest: lsn("0/1000000"), changes: replicaChange{failed: true, recovered: true},
		},
		{
			name:   "an older error is ignored",
			obs:    []ReplicaObservation{robs(10, i1, 1, "0/1000000"), {ObservedAt: at(0), Err: down}},
			replay: replayedAt(1, "0/1000000"), fresh: at(10), usable: true,
			highest: lsn("0/1000000"),
		},
		{
			name:   "a newer observation without a timeline makes the epoch unknown",
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/1000000"), robs(10, i1, 0, "0/1800000")},
			replay: position.Replayed{Epoch: position.Epoch{SystemID: sysID}, LSN: lsn("0/1800000")}, fresh: at(10),
			highest: lsn("0/1000000"),
		},
		{
			name:   "an older observation with a timeline does not undo a newer unknown one",
			obs:    []ReplicaObservation{robs(10, i1, 0, "0/1800000"), robs(0, i1, 1, "0/1000000")},
			replay: position.Replayed{Epoch: position.Epoch{SystemID: sysID}, LSN: lsn("0/1800000")}, fresh: at(10),
		},
		{
			name: "leaving recovery is absorbing within an incarnation",
			obs: []ReplicaObservation{robs(0, i1, 1, "0/1000000"),
				{ObservedAt: at(10), Incarnation: Incarnation{PostmasterStart: i1.PostmasterStart}, InRecovery: false},
				robs(5, i1, 1, "0/1100000"), robs(20, i1, 1, "0/1200000")},
			fresh: at(20), highest: lsn("0/1000000"), changes: replicaChange{leftRecovery: true},
		},
		{
			name:   "impossible: ahead of an insert position the primary reported no earlier",
			p:      primaryAt(50, 1, "0/1000000", nil),
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/0800000"), robs(10, i1, 1, "FFFFFFFF/FFFFFFFF")},
			replay: replayedAt(1, "0/0800000"), err: ErrImpossibleObservation, fresh: at(0),
			highest: lsn("0/0800000"), changes: replicaChange{impossible: true, failed: true},
		},
		{
			name: "a primary read sent while the replica's query ran proves nothing",
			p:    primaryAt(10, 1, "0/1000000", nil),
			obs: []ReplicaObservation{func() ReplicaObservation {
				o := robs(0, i1, 1, "0/1100000")
				o.ReadBy = at(20)
				return o
			}()},
			replay: replayedAt(1, "0/1100000"), fresh: at(0), usable: true,
			highest: lsn("0/1100000"),
		},
		{
			name:   "ahead of an older primary observation is possible (the primary wrote since)",
			p:      primaryAt(-50, 1, "0/1000000", nil),
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/1100000")},
			replay: replayedAt(1, "0/1100000"), fresh: at(0), usable: true,
			highest: lsn("0/1100000"),
		},
		{
			name:   "diverged: an older timeline past the switchpoint",
			p:      primaryAt(-1000, 2, "0/9000000", hist),
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/5000100")},
			replay: replayedAt(1, "0/5000100"), fresh: at(0), usable: true, div: true,
		},
		{
			name:   "not diverged at the switchpoint",
			p:      primaryAt(-1000, 2, "0/9000000", hist),
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/5000000")},
			replay: replayedAt(1, "0/5000000"), fresh: at(0), usable: true,
			highest: lsn("0/5000000"),
		},
		{
			name:   "diverged: a timeline the primary's history does not contain",
			p:      primaryAt(-1000, 3, "0/9000000", hist),
			obs:    []ReplicaObservation{robs(0, i1, 2, "0/4000000")},
			replay: replayedAt(2, "0/4000000"), fresh: at(0), usable: true, div: true,
		},
		{
			name:   "history unknown: divergence cannot be told",
			p:      primaryAt(-1000, 2, "0/9000000", nil),
			obs:    []ReplicaObservation{robs(0, i1, 1, "0/5000100")},
			replay: replayedAt(1, "0/5000100"), fresh: at(0), usable: true,
			highest: lsn("0/5000100"),
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pp := tc.p
			if pp == nil {
				pp = p
			}
			r, chs := foldReplica(pp, tc.obs...)
			var all replicaChange
			for _, ch := range chs {
				all.failed = all.failed || ch.failed
				all.recovered = all.recovered || ch.recovered
				all.restarted = all.restarted || ch.restarted
				all.leftRecovery = all.leftRecovery || ch.leftRecovery
				all.impossible = all.impossible || ch.impossible
				all.superseded = all.superseded || ch.superseded
				all.released = all.released || ch.released
			}
			require.Equal(t, tc.replay, r.Replayed)
			require.Equal(t, tc.err, r.Err)
			require.Equal(t, tc.fresh, r.ObservedAt)
			require.Equal(t, tc.usable, r.Usable(at(-1000)), "usable")
			require.Equal(t, tc.floor, r.RestartFloor, "restart floor")
			require.Equal(t, tc.floor != 0, r.Held(), "held")
			require.Equal(t, tc.highest, r.HighestReplayed, "highest replayed")
			require.Equal(t, tc.div, r.Diverged, "diverged")
			require.Equal(t, tc.changes, all, "changes")
		})
	}
}

// The monotone facts do not depend on the order observations arrive in,
// and the position never exceeds what was observed: a feed may deliver
// several publishers' observations of one replica in any order.
func TestMergeReplicaOrderIndependent(t *testing.T) {
	t.Parallel()
	i1, i2 := inc(0, 1), inc(5000, 5001)
	p := primaryAt(-1000, 1, "F/0", nil)
	var obs []ReplicaObservation
	for k := range 20 {
		o := robs(10*k, i1, 1, position.LSN(0x1000000+0x1000*k).String())
		if k >= 12 {
			o = robs(10*k, i2, 1, position.LSN(0x800000+0x1000*k).String())
		}
		obs = append(obs, o)
	}
	want, _ := foldReplica(p, obs...)
	require.Equal(t, i2, want.Incarnation)
	require.Equal(t, position.LSN(0x800000+0x1000*19), want.Replayed.LSN)
	require.Equal(t, position.LSN(0x1000000+0x1000*11), want.RestartFloor)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		shuffled := append([]ReplicaObservation(nil), obs...)
		rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		got, _ := foldReplica(p, shuffled...)
		require.Equal(t, want.Incarnation, got.Incarnation)
		require.Equal(t, want.Replayed, got.Replayed)
		require.Equal(t, want.ObservedAt, got.ObservedAt)
		// HighestReplayed and the hold depend on which observations of
		// the old incarnation came before the restart was seen (later
		// ones are never used); they never exceed what was observed.
		require.LessOrEqual(t, got.HighestReplayed, position.LSN(0x1000000+0x1000*11))
		require.LessOrEqual(t, got.RestartFloor, position.LSN(0x1000000+0x1000*11))
	}
}

func TestMergePrimary(t *testing.T) {
	t.Parallel()
	hist := position.History{{Timeline: 1, Switchpoint: lsn("0/5000000")}}
	down := errors.New("connection refused")
	other := PrimaryObservation{ObservedAt: at(30), Epoch: position.Epoch{SystemID: 7, Timeline: 1}, InsertLSN: lsn("0/100"), HistoryKnown: true}
	cases := []struct {
		name    string
		obs     []PrimaryObservation
		epoch   position.Epoch
		insert  position.LSN
		hist    bool
		err     error
		fresh   time.Time
		changes primaryChange
	}{
		{
			name:  "insert position by max within an epoch",
			obs:   []PrimaryObservation{pobs(10, 1, "0/3000000", nil), pobs(0, 1, "0/2000000", nil)},
			epoch: ep(1), insert: lsn("0/3000000"), hist: true, fresh: at(10),
		},
		{
			name:  "a newer timeline replaces the state",
			obs:   []PrimaryObservation{pobs(0, 1, "0/6000000", nil), pobs(10, 2, "0/5100000", hist)},
			epoch: ep(2), insert: lsn("0/5100000"), hist: true, fresh: at(10), changes: primaryChange{epochChanged: true},
		},
		{
			name:  "an older timeline, whenever it arrives, is ignored (a former primary)",
			obs:   []PrimaryObservation{pobs(0, 2, "0/5100000", hist), pobs(10, 1, "0/6000000", nil)},
			epoch: ep(2), insert: lsn("0/5100000"), hist: true, fresh: at(0), changes: primaryChange{superseded: true},
		},
		{
			name:  "the history, once known for a timeline, stays",
			obs:   []PrimaryObservation{pobs(0, 2, "0/5100000", hist), {ObservedAt: at(10), Epoch: ep(2), InsertLSN: lsn("0/5200000")}},
			epoch: ep(2), insert: lsn("0/5200000"), hist: true, fresh: at(10),
		},
		{
			name:  "another system replaces the state only when newest",
			obs:   []PrimaryObservation{pobs(40, 1, "0/5100000", nil), other},
			epoch: ep(1), insert: lsn("0/5100000"), hist: true, fresh: at(40), changes: primaryChange{superseded: true},
		},
		{
			name:  "another system, newest",
			obs:   []PrimaryObservation{pobs(20, 1, "0/5100000", nil), other},
			epoch: other.Epoch, insert: other.InsertLSN, hist: true, fresh: at(30), changes: primaryChange{epochChanged: true},
		},
		{
			name:  "a newer error is kept with the last values",
			obs:   []PrimaryObservation{pobs(0, 1, "0/5100000", nil), {ObservedAt: at(10), Err: down}},
			epoch: ep(1), insert: lsn("0/5100000"), hist: true, err: down, fresh: at(0), changes: primaryChange{failed: true},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var p PrimaryState
			var all primaryChange
			for _, o := range tc.obs {
				var ch primaryChange
				p, ch = mergePrimary(p, o)
				all.failed = all.failed || ch.failed
				all.recovered = all.recovered || ch.recovered
				all.epochChanged = all.epochChanged || ch.epochChanged
				all.superseded = all.superseded || ch.superseded
			}
			require.Equal(t, tc.epoch, p.Epoch)
			require.Equal(t, tc.insert, p.InsertLSN)
			require.Equal(t, tc.hist, p.HistoryKnown)
			require.Equal(t, tc.err, p.Err)
			require.Equal(t, tc.fresh, p.ObservedAt)
			require.Equal(t, tc.changes, all)
		})
	}
}

// A primary observation that shows a replica's merged position to be
// impossible drops that position, so that the maximum cannot bring it
// back.
func TestRecheckReplicaDropsImpossiblePosition(t *testing.T) {
	t.Parallel()
	cfg := TrackerConfig{}.WithDefaults()
	p := primaryAt(-1000, 1, "0/1000000", nil)
	r, _ := foldReplica(p, robs(0, inc(0, 1), 1, "FFFFFFFF/0"))
	require.NoError(t, r.Err, "ahead of an older primary observation: possible so far")

	// A primary read sent before the replica's query returned proves
	// nothing; one sent after it does.
	early := robs(0, inc(0, 1), 1, "FFFFFFFF/0")
	early.ReadBy = at(5)
	r2, _ := foldReplica(p, early)
	p1, _ := mergePrimary(*p, pobs(4, 1, "0/1100000", nil))
	_, bad := recheckReplica(r2, &p1, &cfg)
	require.False(t, bad)

	p2, _ := mergePrimary(*p, pobs(10, 1, "0/1100000", nil))
	r, bad = recheckReplica(r, &p2, &cfg)
	require.True(t, bad)
	require.ErrorIs(t, r.Err, ErrImpossibleObservation)
	require.Zero(t, r.Replayed)
	require.False(t, r.Usable(at(-1000)))

	// The next real observation is merged afresh.
	r, _ = mergeReplica(r, robs(20, inc(0, 1), 1, "0/1080000"), &p2, &cfg)
	require.NoError(t, r.Err)
	require.Equal(t, lsn("0/1080000"), r.Replayed.LSN)
	require.True(t, r.Usable(at(-1000)))
}

// nextPoll is the bound on the load waiting puts on a replica: polls of
// one replica are never closer than WaitPollInterval.
func TestNextPoll(t *testing.T) {
	t.Parallel()
	cfg := TrackerConfig{}.WithDefaults()
	require.Equal(t, 5*time.Millisecond, cfg.WaitPollInterval, "at most 200 queries/s per awaited replica")
	last := at(0)
	require.Equal(t, at(100), nextPoll(last, false, &cfg))
	require.Equal(t, at(5), nextPoll(last, true, &cfg))
}

func TestIncarnationCompare(t *testing.T) {
	t.Parallel()
	at := func(s int) time.Time { return time.Unix(1700000000+int64(s), 0) }
	for _, tc := range []struct {
		a, b Incarnation
		want int
	}{
		{Incarnation{PostmasterStart: at(1)}, Incarnation{PostmasterStart: at(2)}, -1},
		{Incarnation{PostmasterStart: at(2), RecoveryStart: at(1)}, Incarnation{PostmasterStart: at(1), RecoveryStart: at(9)}, 1},
		{Incarnation{PostmasterStart: at(1), RecoveryStart: at(2)}, Incarnation{PostmasterStart: at(1), RecoveryStart: at(3)}, -1},
		{Incarnation{PostmasterStart: at(1), RecoveryStart: at(2)}, Incarnation{PostmasterStart: at(1)}, 0},
		{Incarnation{PostmasterStart: at(1)}, Incarnation{PostmasterStart: at(1)}, 0},
	} {
		require.Equal(t, tc.want, tc.a.Compare(tc.b), "%v vs %v", tc.a, tc.b)
		require.Equal(t, -tc.want, tc.b.Compare(tc.a))
	}
}
