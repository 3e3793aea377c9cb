package position

// Status is the outcome of comparing a token entry with a replica.
type Status uint8

const (
	// NotComparable: the replica's history may not contain the entry's
	// position at all (another system, an unknown epoch, or a timeline
	// change the entry cannot be placed in). Route to the primary.
	NotComparable Status = iota
	// Behind: same history, but the replica has not replayed the position
	// yet.
	Behind
	// CaughtUp: the replica has replayed the position; a read there sees
	// everything the entry names.
	CaughtUp
)

func (s Status) String() string {
	switch s {
	case CaughtUp:
		return "caught_up"
	case Behind:
		return "behind"
	}
	return "not_comparable"
}

// Incomparable says why a comparison returned NotComparable.
type Incomparable uint8

const (
	// Comparable is the zero value, used when Status is not NotComparable.
	Comparable Incomparable = iota
	// UnknownEpoch: the entry's or the replica's epoch is unknown.
	UnknownEpoch
	// OtherSystem: different system identifiers; the positions belong to
	// unrelated clusters.
	OtherSystem
	// NewerTimeline: the entry comes from a later timeline than the
	// replica is on; the replica has not followed the promotion yet.
	NewerTimeline
	// UnknownSwitchpoint: the entry is on an older timeline and the
	// history does not say where that timeline ended.
	UnknownSwitchpoint
	// PastSwitchpoint: the entry is on an older timeline past the point
	// where the replica's history left it; it names WAL the new history
	// does not contain, although a numeric comparison would call it
	// replayed.
	PastSwitchpoint
)

func (r Incomparable) String() string {
	switch r {
	case UnknownEpoch:
		return "unknown_epoch"
	case OtherSystem:
		return "other_system"
	case NewerTimeline:
		return "newer_timeline"
	case UnknownSwitchpoint:
		return "unknown_switchpoint"
	case PastSwitchpoint:
		return "past_switchpoint"
	}
	return "comparable"
}

// Replayed is what a replica has applied: its epoch and
// pg_last_wal_replay_lsn(), an end position.
type Replayed struct {
	Epoch Epoch
	LSN   LSN
}

// Comparison is the result of Entry.Compare.
type Comparison struct {
	Status Status
	// BytesBehind is how far the replica's replay is below the entry when
	// Status is Behind.
	BytesBehind uint64
	// Reason is set when Status is NotComparable.
	Reason Incomparable
}

// Compare tells whether a replica that has replayed r contains everything
// the entry names. history is the replica's timeline history (ancestors of
// r.Epoch.Timeline with their switchpoints) and may be nil, in which case
// an entry from an older timeline is NotComparable.
//
// Both the entry and r are end positions (the insert LSN read after commit,
// a transaction's end LSN, pg_last_wal_replay_lsn()), so replay >= entry
// means the replica has the whole transaction. An entry on an ancestor
// timeline compares when its LSN is at or below the switchpoint where the
// replica's history left that timeline: the WAL below the switchpoint is
// shared.
//
// Compare does not allocate and is safe for concurrent use.
func (e Entry) Compare(r Replayed, history History) Comparison {
	switch {
	case e.Epoch.IsZero() || r.Epoch.IsZero():
		return Comparison{Reason: UnknownEpoch}
	case e.Epoch.SystemID != r.Epoch.SystemID:
		return Comparison{Reason: OtherSystem}
	case e.Epoch.Timeline > r.Epoch.Timeline:
		return Comparison{Reason: NewerTimeline}
	case e.Epoch.Timeline < r.Epoch.Timeline:
		sp, ok := history.Switchpoint(e.Epoch.Timeline)
		if !ok {
			return Comparison{Reason: UnknownSwitchpoint}
		}
		if e.LSN > sp {
			return Comparison{Reason: PastSwitchpoint}
		}
	}
	if r.LSN >= e.LSN {
		return Comparison{Status: CaughtUp}
	}
	return Comparison{Status: Behind, BytesBehind: uint64(e.LSN - r.LSN)}
}
