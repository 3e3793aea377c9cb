package consume

import (
	"errors"
	"math"
	"math/bits"
	"time"

	"github.com/caughtup/caughtup/internal/retry"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// Decision says where a job runs, or why it does not run now.
type Decision struct {
	// Policy is the policy applied (never PolicyDefault).
	Policy Policy
	// Action is what to do next.
	Action Action
	// Outcome and Reason summarize the job for metrics and logs: the most
	// degraded of the per-database outcomes.
	Outcome Outcome
	Reason  Reason
	// Fallback: the job runs at least one database on the primary
	// because of lag or unknown replica state. The Router charges such
	// decisions to the fallback cap.
	Fallback bool
	// Delay is how long to defer the job (ActionDefer) or, for
	// ActionRefuse, a suggested retry delay.
	Delay time.Duration
	// TokenAge is the token's age at the decision; zero when unknown.
	TokenAge time.Duration
	// ClockSkew is how far the token's capture time was ahead of the
	// decision time, when that is more than Config.ClockSkewTolerance
	// (the producer's clock is ahead of the consumer's): the token's age
	// is then unknown. Zero otherwise.
	ClockSkew time.Duration
	// Waited is how long the Router waited for a replica, or held the job
	// for a replica or the cap (zero from Decide itself).
	Waited time.Duration
	// Held: the cap refused the job, which could neither be deferred nor
	// refused (Job.Hold), and the Router held it until a replica served
	// it or the cap admitted it.
	Held bool
	// Databases has one entry per database in the token, in the token's
	// order. A database that is not listed is read from the primary. It
	// may alias DecideInput.Buf.
	Databases []DatabaseDecision
}

// Database returns the decision for one database.
func (d *Decision) Database(name string) (DatabaseDecision, bool) {
	for _, dd := range d.Databases {
		if dd.Database == name {
			return dd, true
		}
	}
	return DatabaseDecision{}, false
}

// DatabaseDecision is where one database of a job is read.
type DatabaseDecision struct {
	// Database is the logical name from the token's entry.
	Database string
	// Replica names the replica chosen; "" means the primary.
	Replica string
	// Outcome and Reason say how this database is read and why, as
	// Decision's do for the whole job.
	Outcome Outcome
	Reason  Reason
	// Incomparable says why the token's epoch did not compare, for
	// ReasonEpoch.
	Incomparable position.Incomparable

	// replica indexes Config.Databases[Database].Replicas; -1 is the
	// primary. (Beside the small fields, where it costs no padding: a
	// routed job's context holds a Decision and its Databases.)
	replica int32
	// server is the run of the replica's server the decision judged
	// (ReplicaState.Run): handler connections to it need no check.
	server replay.RunID

	// Entry is the token's entry for this database.
	Entry position.Entry
	// ReadAt is what the chosen replica had replayed when it was chosen;
	// at least Entry's position. Zero for the primary.
	ReadAt position.Replayed
	// BytesBehind is the smallest distance between a healthy replica's
	// replay and Entry, when every replica is behind (0 if not known, as
	// for a replica that has not followed a new timeline yet).
	BytesBehind uint64
}

// DecideInput is everything Decide looks at.
type DecideInput struct {
	// Policy is the job's policy; PolicyDefault (or an invalid value)
	// means Config.DefaultPolicy.
	Policy Policy
	// Token is the job's token; the zero Token means none.
	Token position.Token
	// TokenErr is the error decoding the token, if any: the job then
	// reads the primary (ReasonMalformedToken).
	TokenErr error
	// Snapshot is the tracker's state; nil knows no database.
	Snapshot *replay.Snapshot
	// Now is the decision time, comparable with the snapshot's times.
	Now time.Time
	// Config must have its defaults applied; nil means all defaults.
	Config *Config
	// Waited: the job already waited for a replica, so a replica read is
	// OutcomeReplicaWaited.
	Waited bool
	// NoWait: the wait budget is spent (or waiting is disabled), so
	// Decide must not return ActionWait.
	NoWait bool
	// Capped: the fallback cap refused this job a promotion; Decide turns
	// a Fallback decision into a deferral or OutcomeCapped.
	Capped bool
	// NoDefer: the job cannot be deferred (Job.NoDefer); DeferBy: a
	// deferral must end by then (Job.DeferBy). A job that could otherwise
	// be deferred reads the primary instead (ReasonCannotDefer), and one
	// the cap refuses is refused (OutcomeCapped).
	NoDefer bool
	DeferBy time.Time
	// Spread picks among caught-up replicas (index Spread mod count);
	// pass a rotating counter to spread load while keeping Decide pure.
	Spread uint32
	// Buf is scratch for Decision.Databases; with room for every entry
	// of the token Decide does not allocate.
	Buf []DatabaseDecision
	// Verified is what a Verifier found on replicas earlier decisions
	// for this job had chosen (Job.Verify), index i for
	// Token.Entries[i]; nil when there was nothing to add. It can only
	// make a replica count as behind, or a database read the primary.
	Verified []EntryCheck
}

var defaultConfig = Config{}.WithDefaults()

// Decide routes one job. It is a pure function of its input: no I/O, no
// clock, no randomness, no locks, and it does not allocate when in.Buf has
// room. It never chooses a replica that is not known to have replayed the
// token's position for that database.
//
// Per database named in the token: a caught-up replica if one is usable
// (fresh observation, healthy, in recovery, comparable epoch); else
// "behind" if a usable replica is behind or has not followed a newer
// timeline yet; else the primary (ReasonEpoch, ReasonNoHealthyReplica,
// ReasonTrackerStale, ReasonNoReplicas, ReasonUnknownDatabase). Then the
// policy decides what "behind" means for the whole job: Sticky promotes to
// the primary; Delayed waits (unless NoWait), then defers with a delay
// growing with the token's age, then promotes once the token is older
// than MaxAge. A token of unknown age (no capture time, or one more than
// ClockSkewTolerance ahead of Now) is never deferred: after the wait it
// reads the primary. A job waits or is deferred as a whole, since its
// handler reads all its databases in one run.
func Decide(in DecideInput) Decision {
	var d Decision
	decide(&in, &d)
	return d
}

// decide is Decide writing into *d, which the Router allocates with the
// handler's context: both structs are large enough for their copies to
// show at a consumer's message rate.
func decide(in *DecideInput, d *Decision) {
	cfg := in.Config
	if cfg == nil {
		cfg = &defaultConfig
	}
	// One entry per database, or the databases would be routed one entry
	// at a time and the pool handed out for the first (a token built by
	// hand); tokens from Decode and Merge already are, at no cost.
	if !in.Token.Normal() {
		in.Token = in.Token.Normalize()
	}
	pol := cfg.policy(in.Policy)
	*d = Decision{Policy: pol, Action: ActionRun, Outcome: OutcomeReplica, Reason: ReasonNone, Databases: in.Buf[:0]}
	age, ageKnown, skew := tokenAge(in.Token, in.Now, cfg.ClockSkewTolerance)
	d.TokenAge, d.ClockSkew = age, skew

	switch {
	case in.TokenErr != nil:
		d.Outcome, d.Reason = OutcomePrimaryNoToken, ReasonMalformedToken
		return
	case in.Token.IsZero():
		d.Outcome, d.Reason = OutcomePrimaryNoToken, ReasonNoToken
		return
	case pol == Always:
		for _, e := range in.Token.Entries {
			d.Databases = append(d.Databases, DatabaseDecision{
				Database: e.Database, Entry: e, Outcome: OutcomePrimary, Reason: ReasonPolicyAlways, replica: -1,
			})
		}
		d.Outcome, d.Reason = OutcomePrimary, ReasonPolicyAlways
		return
	}

	var behind, epoch, other int
	cutoff := in.Now.Add(-cfg.Tracker.StalenessBound)
	for i, e := range in.Token.Entries {
		d.Databases = append(d.Databases, DatabaseDecision{})
		dd := &d.Databases[len(d.Databases)-1]
		var vc EntryCheck
		if i < len(in.Verified) {
			vc = in.Verified[i]
		}
		if vc.Unknown {
			dd.Database, dd.Entry, dd.replica, dd.Outcome, dd.Reason = e.Database, e, -1, OutcomePrimary, ReasonUnverified
		} else {
			decideDatabaseAfter(dd, e, in.Snapshot.Database(e.Database), cutoff, in.Spread, vc.After)
		}
		switch {
		case dd.Outcome == OutcomeReplica && in.Waited:
			dd.Outcome = OutcomeReplicaWaited
		case dd.Outcome == outcomeWait:
			behind++
		case dd.Outcome == OutcomePrimaryEpoch:
			epoch++
		case dd.Reason.fallback():
			// Counted below, after behind databases are resolved.
		case dd.Outcome == OutcomePrimary:
			other++
		}
	}

	if behind > 0 {
		promote := ReasonReplicaBehind
		if pol == Delayed {
			switch {
			case ageKnown && age >= cfg.MaxAge:
				promote = ReasonDeadline
			case !in.NoWait:
				d.setAll(outcomeWait, outcomeWait, ReasonReplicaBehind, ActionWait)
				return
			case !ageKnown:
				promote = ReasonUnknownAge
			default:
				if delay := deferDelay(age, cfg); in.canDefer(delay) {
					d.Delay = delay
					d.setAll(outcomeWait, OutcomeDeferred, ReasonReplicaBehind, ActionDefer)
					return
				}
				promote = ReasonCannotDefer
			}
		}
		refuse := false
		for i := range d.Databases {
			if dd := &d.Databases[i]; dd.Outcome == outcomeWait {
				if dd.Reason == ReasonPrimaryBehind {
					refuse = true // the primary lacks the entry's writes
					continue
				}
				dd.Outcome, dd.Reason = OutcomePrimary, promote
			}
		}
		if refuse {
			d.Delay = deferStep(age, cfg)
			for i := range d.Databases {
				if dd := &d.Databases[i]; dd.Outcome == outcomeWait {
					dd.Outcome = OutcomeRefused
				}
			}
			d.Action, d.Outcome, d.Reason = ActionRefuse, OutcomeRefused, ReasonPrimaryBehind
			return
		}
	}

	// The first fallback database names the job's reason.
	fallback := ReasonNone
	for i := range d.Databases {
		if r := d.Databases[i].Reason; r.fallback() {
			fallback = r
			break
		}
	}
	switch {
	case fallback != ReasonNone && in.Capped:
		if delay := deferDelay(age, cfg); pol == Delayed && ageKnown && age < cfg.MaxAge && in.canDefer(delay) {
			d.Delay = delay
			d.setAll(OutcomePrimary, OutcomeDeferred, ReasonCapped, ActionDefer)
			return
		}
		d.Delay = deferStep(age, cfg)
		d.setAll(OutcomePrimary, OutcomeCapped, ReasonCapped, ActionRefuse)
		return
	case fallback != ReasonNone:
		d.Fallback = true
		d.Outcome, d.Reason = OutcomePrimary, fallback
	case epoch > 0:
		d.Outcome, d.Reason = OutcomePrimaryEpoch, ReasonEpoch
	case other > 0:
		for i := range d.Databases {
			if dd := &d.Databases[i]; dd.Outcome == OutcomePrimary {
				d.Outcome, d.Reason = OutcomePrimary, dd.Reason
				break
			}
		}
	case in.Waited:
		d.Outcome = OutcomeReplicaWaited
	}
}

// canDefer reports whether the job may be deferred for delay.
func (in *DecideInput) canDefer(delay time.Duration) bool {
	return !in.NoDefer && (in.DeferBy.IsZero() || !in.Now.Add(delay).After(in.DeferBy))
}

// setAll gives the job an outcome and relabels the databases that caused
// it (outcome from; for the primary, only fallbacks) the same way, keeping
// their own reasons.
func (d *Decision) setAll(from, to Outcome, reason Reason, a Action) {
	for i := range d.Databases {
		if dd := &d.Databases[i]; dd.Outcome == from && (from != OutcomePrimary || dd.Reason.fallback()) {
			dd.Outcome = to
		}
	}
	d.Action, d.Outcome, d.Reason = a, to, reason
}

// tokenAge is the token's age at now and whether it is known, from the
// producer's wall clock (a monotonic reading would not help). A capture
// time ahead of now by at most tolerance counts as age 0. One further
// ahead makes the age unknown, and ahead says by how much: clamping it
// to now would not bound deferral, since every attempt decides afresh
// and would find the token new again for as long as the skew lasts,
// while an unknown age is never deferred (Decide). time.Time.Sub
// saturates, so capture times centuries away are safe.
func tokenAge(t position.Token, now time.Time, tolerance time.Duration) (age time.Duration, known bool, ahead time.Duration) {
	if t.CapturedAt.IsZero() {
		return 0, false, 0
	}
	age = now.Sub(t.CapturedAt)
	switch {
	case age >= 0:
		return age, true, 0
	case age >= -tolerance:
		return 0, true, 0
	case age == math.MinInt64:
		return 0, false, math.MaxInt64
	}
	return 0, false, -age
}

// maxCandidates bounds the caught-up replicas Spread chooses among (a
// bitmask); replicas past the 64th are never chosen.
const maxCandidates = 64

// decideDatabase fills dd (zero) for one token entry; replicas observed
// before cutoff are stale.
func decideDatabase(dd *DatabaseDecision, e position.Entry, db *replay.DatabaseState, cutoff time.Time, spread uint32) {
	decideDatabaseAfter(dd, e, db, cutoff, spread, 0)
}

// decideDatabaseAfter is decideDatabase where, besides, replicas that have
// not replayed past after (non-zero: a Verifier found one there without
// the job's writes) are behind.
func decideDatabaseAfter(dd *DatabaseDecision, e position.Entry, db *replay.DatabaseState, cutoff time.Time, spread uint32, after position.LSN) {
	dd.Database, dd.Entry, dd.replica, dd.Outcome = e.Database, e, -1, OutcomePrimary
	if db == nil {
		dd.Reason = ReasonUnknownDatabase
		return
	}
	if len(db.Replicas) == 0 {
		dd.Reason = ReasonNoReplicas
		return
	}
	p := &db.Primary
	e.LSN = p.WAL.InsertEnd(e.LSN)
	var hist position.History
	histKnown := !p.Epoch.IsZero() && p.HistoryKnown
	if histKnown {
		hist = p.History
	}
	// The primary holds every position of its history: if the entry is not
	// comparable even there, no replica of it can serve the entry. With
	// the primary unknown, the replicas' own epochs still decide.
	if e.Epoch.IsZero() {
		dd.Outcome, dd.Reason, dd.Incomparable = OutcomePrimaryEpoch, ReasonEpoch, position.UnknownEpoch
		return
	}
	// ahead: the entry is from a newer timeline of the primary's system
	// than the router's primary: a failover the tracker has not seen. Only
	// a replica that follows the new timeline can serve it, never the
	// primary.
	ahead := false
	if !p.Epoch.IsZero() {
		if c := e.Compare(position.Replayed{Epoch: p.Epoch, LSN: math.MaxUint64}, hist); c.Status == position.NotComparable {
			if c.Reason != position.NewerTimeline {
				dd.Outcome, dd.Reason, dd.Incomparable = OutcomePrimaryEpoch, ReasonEpoch, c.Reason
				return
			}
			ahead = true
		}
	}

	var caught uint64 // bit i: replica i is caught up
	nc := uint32(0)
	behind, held := false, true // held: every replica behind is held after a restart
	minBehind := uint64(math.MaxUint64)
	usable, stale, divergent, ungranted := 0, 0, 0, 0
	notCmp := position.Comparable
	for i := range db.Replicas {
		r := &db.Replicas[i]
		if !r.Usable(cutoff) {
			switch {
			case r.Err == nil && r.Stale(cutoff):
				stale++
			case r.Err != nil && errors.Is(r.Err, replay.ErrMissingGrant):
				ungranted++
			}
			continue
		}
		// A diverged standby holds WAL the primary's history lacks:
		// neither read (it may show rows the primary never had) nor
		// waited on (it never reaches the primary's timeline).
		if histKnown && p.Diverged(r.Replayed) {
			divergent++
			continue
		}
		usable++
		// The primary's history is the replica's too when the replica is
		// on the primary's timeline or an ancestor of it; a replica ahead
		// of what the tracker knows of the primary gets none, so older
		// entries are not comparable there.
		var rh position.History
		if histKnown && r.Replayed.Epoch.SystemID == p.Epoch.SystemID && r.Replayed.Epoch.Timeline <= p.Epoch.Timeline {
			rh = hist
		}
		c := e.Compare(r.Replayed, rh)
		switch {
		case c.Status == position.CaughtUp && r.Held():
			// Restarted: it may show less than it had replayed until it
			// passes RestartFloor.
			behind = true
			minBehind = min(minBehind, r.Replayed.LSN.BytesBefore(max(e.LSN, r.RestartFloor)))
		case c.Status == position.CaughtUp && after != 0 && r.Replayed.LSN <= after:
			// A replica at or below after was found without the job's
			// writes; every replica replays the same WAL, so this one
			// lacks them too until it passes after.
			behind = true
			held = held && r.Held()
			minBehind = min(minBehind, uint64(after-r.Replayed.LSN)+1)
		case c.Status == position.CaughtUp:
			if i < maxCandidates {
				caught |= 1 << i
				nc++
			}
		case c.Status == position.Behind:
			behind = true
			held = held && r.Held()
			minBehind = min(minBehind, c.BytesBehind)
		case c.Reason == position.NewerTimeline:
			// Not yet following the promotion the entry was written
			// after; it may within the wait.
			behind = true
			held = held && r.Held()
		default:
			notCmp = c.Reason
		}
	}
	switch {
	case nc == 0 && ahead:
		dd.Outcome, dd.Reason = outcomeWait, ReasonPrimaryBehind
		if minBehind != math.MaxUint64 {
			dd.BytesBehind = minBehind
		}
	case nc > 0:
		for range spread % nc {
			caught &= caught - 1 // drop the lowest candidate
		}
		k := int32(bits.TrailingZeros64(caught))
		r := &db.Replicas[k]
		dd.Outcome, dd.Reason, dd.Replica, dd.replica, dd.ReadAt, dd.server = OutcomeReplica, ReasonNone, r.Name, k, r.Replayed, r.Run
	case behind:
		dd.Outcome, dd.Reason = outcomeWait, ReasonReplicaBehind
		if held {
			dd.Reason = ReasonReplicaRestarted
		}
		if minBehind != math.MaxUint64 {
			dd.BytesBehind = minBehind
		}
	case usable > 0:
		dd.Outcome, dd.Reason, dd.Incomparable = OutcomePrimaryEpoch, ReasonEpoch, notCmp
	case divergent > 0:
		dd.Reason = ReasonDivergedStandby
	case ungranted > 0:
		dd.Reason = ReasonMissingGrant
	case stale == len(db.Replicas):
		dd.Reason = ReasonTrackerStale
	default:
		dd.Reason = ReasonNoHealthyReplica
	}
}

// deferDelay is the delay of the deferral step a token of this age has
// reached, cut so that the job is back by MaxAge, when it reads the
// primary rather than waiting more.
func deferDelay(age time.Duration, cfg *Config) time.Duration {
	d := deferStep(age, cfg)
	if left := cfg.MaxAge - age; d > left {
		d = left
	}
	return d
}

// deferStep walks the exponential schedule (without randomization, so
// the result is a function of age) until the deferrals it implies add up
// to more than age.
func deferStep(age time.Duration, cfg *Config) time.Duration {
	b := retry.NewSteps(cfg.DeferInitial, cfg.DeferMax, cfg.DeferMultiplier)
	var elapsed time.Duration
	d := b.Next()
	for elapsed+d <= age && d < cfg.DeferMax {
		next := b.Next()
		if next <= d {
			break // a multiplier of 1 never grows
		}
		elapsed += d
		d = next
	}
	return d
}
