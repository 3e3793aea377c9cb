package replay

import (
	"errors"
	"fmt"
	"time"
	"unique"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
)

// Incarnation identifies one run of a server: pg_postmaster_start_time()
// and the start of its startup process (the one that replays WAL). A
// replica's replay only grows within one incarnation, and may start lower
// in the next (design fact 9). PostmasterStart
// changes when the server restarts, RecoveryStart also when the postmaster
// reinitializes after a backend crash. Later is newer.
type Incarnation struct {
	PostmasterStart time.Time
	RecoveryStart   time.Time
}

// IsZero reports an incarnation that was not read.
func (i Incarnation) IsZero() bool { return i.PostmasterStart.IsZero() }

// Compare orders incarnations of one server: -1 if i is older than o, +1
// if newer, 0 if they cannot be told apart. RecoveryStart decides only
// when the postmaster is the same and both know it.
func (i Incarnation) Compare(o Incarnation) int {
	if c := i.PostmasterStart.Compare(o.PostmasterStart); c != 0 {
		return c
	}
	if i.RecoveryStart.IsZero() || o.RecoveryStart.IsZero() {
		return 0
	}
	return i.RecoveryStart.Compare(o.RecoveryStart)
}

// RunID is an Incarnation interned (unique.Handle): two RunIDs are equal
// exactly when their incarnations are, and comparing them costs a pointer
// comparison. The router ties each handler connection to the run its
// decision judged by it. The zero RunID names no run.
type RunID struct{ h unique.Handle[Incarnation] }

// ID returns i interned; the zero RunID for the zero Incarnation.
func (i Incarnation) ID() RunID {
	if i.IsZero() {
		return RunID{}
	}
	return RunID{unique.Make(i)}
}

// IsZero reports the RunID of no run.
func (r RunID) IsZero() bool { return r == RunID{} }

// Incarnation returns the run r names.
func (r RunID) Incarnation() Incarnation {
	if r.IsZero() {
		return Incarnation{}
	}
	return r.h.Value()
}

// incarnationOf is the run a pgwal reading belongs to.
func incarnationOf(r pgwal.Replica) Incarnation {
	return Incarnation{PostmasterStart: r.PostmasterStart, RecoveryStart: r.RecoveryStart}
}

// ErrImpossibleObservation is the Err of a replica whose observation
// cannot be true: a replay position ahead of the insert position that its
// primary, in the same epoch, reported no earlier. The replica counts as
// unknown until a newer observation is possible.
var ErrImpossibleObservation = errors.New("caughtup/replay: impossible observation: the replica's replay position is ahead of its primary's insert position")

// ErrMissingGrant is matched by the Err of a node whose tracker role lacks
// a privilege the tracker needs (a *GrantError says which, and the GRANT
// to run): the node counts as unknown, and decisions name the reason
// (consume.ReasonMissingGrant) rather than a vague no_healthy_replica.
var ErrMissingGrant = errors.New("caughtup/replay: the tracker's role lacks a privilege")

// GrantError is a node's Err when the tracker's role lacks a privilege.
type GrantError struct {
	// Role is the role the tracker connects as.
	Role string
	// Privilege names what is missing ("pg_read_all_stats", "EXECUTE on
	// pg_control_system()", "CONNECT on database app"); Grant is the
	// statement to run on the primary; Lost says what caughtup cannot do
	// without it.
	Privilege, Grant, Lost string
	// Err is the query's or the connection's error, if one told.
	Err error
}

func (e *GrantError) Error() string {
	return fmt.Sprintf("caughtup/replay: role %q lacks %s (%s); run on the primary: %s", e.Role, e.Privilege, e.Lost, e.Grant)
}

// Is matches ErrMissingGrant.
func (e *GrantError) Is(target error) bool { return target == ErrMissingGrant }

// Unwrap returns the query's error.
func (e *GrantError) Unwrap() error { return e.Err }

// grantError is the GrantError for what err, or a reading that hides the
// standby's timeline, says the role lacks; nil if neither.
func grantError(role string, err error, hidden bool) *GrantError {
	p, ok := pgwal.MissingPrivilege(err)
	if !ok && hidden {
		p, ok = pgwal.ReadAllStats, true
	}
	if !ok {
		return nil
	}
	return &GrantError{Role: role, Privilege: p.Name(), Grant: p.GrantSQL(role), Lost: p.Lost, Err: err}
}

// PrimaryObservation is what one poll of a database's primary returned.
// The tracker makes one per poll and merges it into the snapshot (see
// "How observations merge" in the package documentation); a position feed
// delivers the same values.
type PrimaryObservation struct {
	// ObservedAt is the local clock when the query was sent (polling), or
	// when the feed message carrying the observation was received. Never
	// another process's clock: staleness is judged by it.
	ObservedAt time.Time
	// Err is the query's error; nothing else is set then.
	Err error
	// Epoch is the system identifier and the current WAL file's timeline.
	Epoch position.Epoch
	// InsertLSN is pg_current_wal_insert_lsn() as returned.
	InsertLSN position.LSN
	// WAL is the server's WAL geometry.
	WAL position.WALLayout
	// History lists the ancestors of Epoch.Timeline, valid when
	// HistoryKnown (always on timeline 1, where it is empty).
	History      position.History
	HistoryKnown bool
}

// ReplicaObservation is what one poll of a replica returned. An
// observation without an Incarnation cannot reveal a restart: a feed must
// carry it.
type ReplicaObservation struct {
	// ObservedAt: as PrimaryObservation.ObservedAt. The values were read
	// at or after it.
	ObservedAt time.Time
	// ReadBy is the local time by which the values had certainly been
	// read: when the query returned (polling), or when the feed message was
	// received. Zero means ObservedAt. A primary observation made after it
	// shows what the replica cannot have exceeded (rule 4).
	ReadBy time.Time
	// Err is the query's error; nothing else is set then.
	Err error
	// Incarnation is the server run the values belong to.
	Incarnation Incarnation
	// InRecovery is pg_is_in_recovery().
	InRecovery bool
	// Replayed is pg_last_wal_replay_lsn() (0 for NULL) with the system
	// identifier and received_tli; the timeline is 0 when no WAL receiver
	// runs (or the role lacks pg_read_all_stats). Unset when not in
	// recovery.
	Replayed position.Replayed
	// ReplayTimestamp and TimeLag (server side) describe the last
	// replayed transaction; zero when none.
	ReplayTimestamp time.Time
	TimeLag         time.Duration

	// own: the tracker's own poll on its own connection, not a feed
	// message. A run older than the state's can then only be another
	// server that the connection reached (a balanced endpoint, a DNS
	// move), never a late message.
	own bool
}

// mergePrimary folds o into p (rules 1 to 3 of "How observations merge"
// in the package documentation).
func mergePrimary(p PrimaryState, o PrimaryObservation) (PrimaryState, primaryChange) {
	var ch primaryChange
	if o.Err != nil {
		if !o.ObservedAt.Before(p.ObservedAt) && !o.ObservedAt.Before(p.errAt) {
			ch.failed = p.Err == nil
			p.Err, p.errAt = o.Err, o.ObservedAt
		}
		return p, ch
	}
	newest := !o.ObservedAt.Before(p.ObservedAt)
	take := func() {
		ch.epochChanged = !p.Epoch.IsZero() && p.Epoch != o.Epoch
		p.Epoch, p.InsertLSN, p.insertAt, p.WAL = o.Epoch, o.InsertLSN, o.ObservedAt, o.WAL
		p.History, p.HistoryKnown = o.History, o.HistoryKnown
	}
	switch {
	case o.Epoch.IsZero():
		return p, ch // nothing to merge (a publisher that failed to parse)
	case p.Epoch.IsZero():
		take()
	case o.Epoch.SystemID != p.Epoch.SystemID:
		if !newest {
			ch.superseded = true
			return p, ch
		}
		take()
	case o.Epoch.Timeline > p.Epoch.Timeline:
		take()
	case o.Epoch.Timeline < p.Epoch.Timeline:
		// A former primary, or an observation from before the promotion.
		ch.superseded = true
		return p, ch
	default:
		if o.InsertLSN > p.InsertLSN || (o.InsertLSN == p.InsertLSN && o.ObservedAt.After(p.insertAt)) {
			p.InsertLSN, p.insertAt = o.InsertLSN, o.ObservedAt
		}
		if !p.HistoryKnown && o.HistoryKnown {
			p.History, p.HistoryKnown = o.History, true
		}
		if p.WAL == (position.WALLayout{}) {
			p.WAL = o.WAL
		}
	}
	if newest {
		p.ObservedAt = o.ObservedAt
	}
	if p.Err != nil && p.ObservedAt.After(p.errAt) {
		ch.recovered = true
		p.Err = nil
	}
	return p, ch
}

// primaryChange says what a primary merge changed, for logs and metrics.
type primaryChange struct {
	failed, recovered, epochChanged, superseded bool
}

// replicaChange says what a replica merge changed, for logs and metrics.
type replicaChange struct {
	failed, recovered bool
	// restarted: a newer incarnation replaced the state.
	restarted bool
	// leftRecovery: the node is no longer a standby (promoted).
	leftRecovery bool
	// impossible: the observation, or the merged position, could not be
	// true (rule 4).
	impossible bool
	// superseded: the observation belonged to an older incarnation.
	superseded bool
	// released: the replica reached its RestartFloor.
	released bool
	// serverChanged: the tracker's own connection reached another server.
	serverChanged bool
}

// mergeReplica folds o into r, given the database's primary state p (rules
// 1 to 5 of "How observations merge" in the package documentation). cfg
// supplies the lag thresholds.
func mergeReplica(r ReplicaState, o ReplicaObservation, p *PrimaryState, cfg *TrackerConfig) (ReplicaState, replicaChange) {
	var ch replicaChange
	readBy := o.ReadBy
	if readBy.IsZero() || readBy.Before(o.ObservedAt) {
		readBy = o.ObservedAt
	}
	if o.Err == nil && impossible(o.Replayed, readBy, p) {
		ch.impossible = true
		o = ReplicaObservation{ObservedAt: o.ObservedAt, Err: ErrImpossibleObservation}
	}
	if o.Err != nil {
		if !o.ObservedAt.Before(r.ObservedAt) && !o.ObservedAt.Before(r.errAt) {
			ch.failed = r.Err == nil
			r.Err, r.errAt = o.Err, o.ObservedAt
		}
		deriveReplica(&r, p, cfg)
		return r, ch
	}

	newest := !o.ObservedAt.Before(r.ObservedAt)
	cmp := 0
	if !o.Incarnation.IsZero() && !r.Incarnation.IsZero() {
		cmp = o.Incarnation.Compare(r.Incarnation)
	}
	switch {
	case cmp < 0 && !o.own:
		ch.superseded = true
		return r, ch
	case cmp < 0:
		// The tracker's own connection now reaches another server: its
		// state replaces the old one's, which says nothing about it.
		ch.serverChanged = true
		r.Incarnation = o.Incarnation
		r.InRecovery = o.InRecovery
		r.Replayed, r.ReplayedBy = o.Replayed, readBy
		if !o.InRecovery {
			r.Replayed = position.Replayed{}
		}
		r.ReplayTimestamp, r.TimeLag = o.ReplayTimestamp, max(o.TimeLag, 0)
		r.ObservedAt = o.ObservedAt
		r.RestartFloor, r.HighestReplayed = 0, 0
	case cmp > 0 || r.Observations == 0:
		// A restart (or the first observation): the new run's values
		// replace the old ones; only what no decision may exceed is kept.
		if cmp > 0 {
			ch.restarted = true
			r.Restarts++
			r.RestartFloor = max(r.RestartFloor, r.HighestReplayed)
		}
		r.Incarnation = o.Incarnation
		r.InRecovery = o.InRecovery
		r.Replayed, r.ReplayedBy = o.Replayed, readBy
		if !o.InRecovery {
			r.Replayed = position.Replayed{}
		}
		r.ReplayTimestamp, r.TimeLag = o.ReplayTimestamp, max(o.TimeLag, 0)
		r.ObservedAt = o.ObservedAt
	default:
		if r.Incarnation.IsZero() {
			r.Incarnation = o.Incarnation
		}
		switch {
		case !o.InRecovery:
			ch.leftRecovery = r.InRecovery
			r.InRecovery = false
			r.Replayed = position.Replayed{}
		case !r.InRecovery:
			// An observation from before the promotion.
		case o.Replayed.Epoch.IsZero():
			// Timeline unknown: a transient condition (rule 3).
			if newest {
				r.Replayed, r.ReplayedBy = o.Replayed, readBy
			}
		case r.Replayed.Epoch.IsZero():
			if newest {
				r.Replayed, r.ReplayedBy = o.Replayed, readBy
			}
		case o.Replayed.Epoch.SystemID != r.Replayed.Epoch.SystemID:
			// Another cluster in one server run cannot be.
			ch.impossible = true
			r.Replayed, r.ReplayedBy = position.Replayed{}, time.Time{}
			if newest {
				r.Err, r.errAt = ErrImpossibleObservation, o.ObservedAt
			}
		case later(o.Replayed, r.Replayed):
			r.Replayed, r.ReplayedBy = o.Replayed, readBy
		}
		if newest {
			r.ReplayTimestamp, r.TimeLag = o.ReplayTimestamp, max(o.TimeLag, 0)
			r.ObservedAt = o.ObservedAt
		}
	}
	r.Observations++
	// A feed observation's time is when its message was received, less
	// the age the feed measured: later than the read by the message's
	// transit, so a late message from before a restart can look newer
	// than the restart claim. Only the router's own poll, which confirms
	// or contradicts the claim, ends it.
	if r.Err != nil && r.ObservedAt.After(r.errAt) && (o.own || !errors.Is(r.Err, ErrUnconfirmedRestart)) {
		ch.recovered = true
		r.Err = nil
	}
	deriveReplica(&r, p, cfg)
	if r.RestartFloor != 0 && r.InRecovery && !r.Replayed.Epoch.IsZero() && r.Replayed.LSN >= r.RestartFloor {
		ch.released = true
		r.RestartFloor = 0
	}
	return r, ch
}

// later orders two positions of one replica run: by timeline, then LSN.
func later(a, b position.Replayed) bool {
	if a.Epoch.Timeline != b.Epoch.Timeline {
		return a.Epoch.Timeline > b.Epoch.Timeline
	}
	return a.LSN > b.LSN
}

// impossible reports a replica position, read by readBy, ahead of the
// primary's insert position of the same epoch read after it: the primary's
// observation was made (its query sent) no earlier than readBy (rule 4).
// With the tracker's own polls that proves the order of the two reads; a
// primary query sent while the replica's was still running proves nothing
// and is not used.
func impossible(r position.Replayed, readBy time.Time, p *PrimaryState) bool {
	return p != nil && !p.Epoch.IsZero() && r.Epoch == p.Epoch &&
		r.LSN > p.InsertLSN && !p.insertAt.IsZero() && !p.insertAt.Before(readBy)
}

// recheckReplica applies rule 4 to a replica after its primary's state
// changed, and recomputes what derives from the primary (rule 5).
func recheckReplica(r ReplicaState, p *PrimaryState, cfg *TrackerConfig) (ReplicaState, bool) {
	bad := r.InRecovery && impossible(r.Replayed, r.ReplayedBy, p)
	if bad {
		r.Replayed, r.ReplayedBy = position.Replayed{}, time.Time{}
		if !p.insertAt.Before(r.errAt) {
			r.Err, r.errAt = ErrImpossibleObservation, p.insertAt
		}
	}
	deriveReplica(&r, p, cfg)
	return r, bad
}

// deriveReplica recomputes the values that follow from the replica's
// merged state and its primary (rule 5).
func deriveReplica(r *ReplicaState, p *PrimaryState, cfg *TrackerConfig) {
	r.LagBytes, r.LagKnown = 0, false
	if p != nil && !p.Epoch.IsZero() && p.Epoch == r.Replayed.Epoch && r.Replayed.LSN != 0 {
		r.LagBytes, r.LagKnown = r.Replayed.LSN.BytesBefore(p.InsertLSN), true
	}
	r.Healthy = !r.LagKnown ||
		(r.LagBytes <= cfg.MaxLagBytes && (r.LagBytes == 0 || r.TimeLag <= cfg.MaxLagTime))
	r.Diverged = p != nil && p.Diverged(r.Replayed)
	r.Run = r.Incarnation.ID()
	if r.Err == nil && r.InRecovery && !r.Replayed.Epoch.IsZero() && !r.Diverged {
		r.HighestReplayed = max(r.HighestReplayed, r.Replayed.LSN)
	}
}

// Diverged reports a replica position on an older timeline of the
// primary's system that the primary's (known) history does not contain:
// past the switchpoint where the history left that timeline, or on a
// timeline the history does not list at all. Such a standby holds WAL the
// primary lacks and will never reach the primary's timeline. With the
// history unknown nothing can be said (tokens from older timelines then
// read the primary anyway).
func (p *PrimaryState) Diverged(r position.Replayed) bool {
	if p.Epoch.IsZero() || !p.HistoryKnown || r.Epoch.IsZero() ||
		r.Epoch.SystemID != p.Epoch.SystemID || r.Epoch.Timeline >= p.Epoch.Timeline {
		return false
	}
	sp, ok := p.History.Switchpoint(r.Epoch.Timeline)
	return !ok || r.LSN > sp
}
