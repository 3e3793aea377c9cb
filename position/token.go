package position

import (
	"slices"
	"strings"
	"time"
)

// Source says where a token entry's position came from. It decides nothing
// in routing (every source is compared the same way) but explains a
// decision in logs and metrics.
type Source uint8

const (
	// SourceUnknown is the zero value: a token built by hand.
	SourceUnknown Source = iota
	// SourcePrimary: the primary's insert position read right after the
	// producer's COMMIT returned.
	SourcePrimary
	// SourceReplica: the replay position of the replica the producer read
	// from (GitLab's replica-sourced location): jobs that follow a read
	// must see at least what that read saw.
	SourceReplica
	// SourceCDC: the end position of a transaction seen in logical
	// replication or carried by a CDC event.
	SourceCDC
)

var sourceNames = [...]string{"unknown", "primary", "replica", "cdc"}
var sourceCodes = [...]byte{'u', 'p', 'r', 'c'}

func (s Source) String() string {
	if int(s) < len(sourceNames) {
		return sourceNames[s]
	}
	return "unknown"
}

// MarshalText implements encoding.TextMarshaler.
func (s Source) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (s *Source) UnmarshalText(b []byte) error {
	for i, n := range sourceNames {
		if string(b) == n {
			*s = Source(i)
			return nil
		}
	}
	return &SyntaxError{What: "source", Input: string(b)}
}

// Entry is what a token says about one database: the position a reader
// must have replayed, and the history that position belongs to.
type Entry struct {
	// Database is the caller's logical name for the database ("main"),
	// the key consumers use to find its primary and replicas. It is not
	// necessarily the PostgreSQL database name.
	Database string `json:"database"`
	Epoch    Epoch  `json:"epoch"`
	// LSN is an end position: everything the producer wrote or read is
	// below it, so a replica with replay >= LSN has it.
	LSN    LSN    `json:"lsn"`
	Source Source `json:"source"`
}

// Token is what a job carries: one entry per database it wrote to or read
// from, sorted by database name with no duplicates, and when the first of
// them was captured. The zero Token is empty: the job says nothing about
// freshness, and consumers treat it as unknown (primary).
//
// A Token is a value; its methods never modify the receiver's entries in
// place, so tokens can be shared between goroutines.
type Token struct {
	Entries []Entry `json:"entries"`
	// CapturedAt is when the oldest entry was captured. Consumers bound
	// how long a job may wait or be deferred by the token's age, and the
	// oldest capture is the conservative choice: it sends a job to the
	// primary sooner, never to a stale replica. Zero means unknown.
	CapturedAt time.Time `json:"captured_at"`
}

// New returns a token with a single entry.
func New(database string, epoch Epoch, lsn LSN, source Source, capturedAt time.Time) Token {
	return Token{
		Entries:    []Entry{{Database: database, Epoch: epoch, LSN: lsn, Source: source}},
		CapturedAt: capturedAt,
	}
}

// IsZero reports whether the token has no entries.
func (t Token) IsZero() bool { return len(t.Entries) == 0 }

// Entry returns the entry for database.
func (t Token) Entry(database string) (Entry, bool) {
	for _, e := range t.Entries {
		if e.Database == database {
			return e, true
		}
	}
	return Entry{}, false
}

// Age is how long ago the token was captured; zero when unknown.
func (t Token) Age(now time.Time) time.Duration {
	if t.CapturedAt.IsZero() {
		return 0
	}
	return now.Sub(t.CapturedAt)
}

// Merge returns a token that is satisfied only where both t and o are:
// for each database, the furthest position of the two. Merge is
// commutative and associative, so a handler may fold any number of writes,
// reads and inherited tokens into one in any order.
//
// Entries of one database are combined by their epochs:
//
//   - Same epoch: the larger LSN.
//   - Same system, different timelines: the later timeline with the larger
//     of the two LSNs. A later timeline descends from the earlier one. If
//     the earlier entry lies in the shared history (at or below the
//     switchpoint) the new timeline contains it once it passes that
//     number; if it lies past the switchpoint, the write it names was lost
//     at failover and no server has it, so waiting for the number costs a
//     little time but never admits a stale read.
//   - Different systems (the database was rebuilt or restored), or an
//     unknown epoch on either side: the entry gets the zero Epoch, which
//     never compares as caught up, so the job reads that database from the
//     primary. There is no way to know which history the job needs.
//
// The source of the kept LSN is kept; CapturedAt is the earlier of the
// two (zero counts as unknown and loses to a known time).
func (t Token) Merge(o Token) Token {
	t, o = t.Normalize(), o.Normalize()
	if o.IsZero() && o.CapturedAt.IsZero() {
		return t
	}
	if t.IsZero() && t.CapturedAt.IsZero() {
		return o
	}
	out := Token{CapturedAt: earliest(t.CapturedAt, o.CapturedAt)}
	out.Entries = make([]Entry, 0, len(t.Entries)+len(o.Entries))
	i, j := 0, 0
	for i < len(t.Entries) || j < len(o.Entries) {
		switch {
		case j >= len(o.Entries) || (i < len(t.Entries) && t.Entries[i].Database < o.Entries[j].Database):
			out.Entries = append(out.Entries, t.Entries[i])
			i++
		case i >= len(t.Entries) || o.Entries[j].Database < t.Entries[i].Database:
			out.Entries = append(out.Entries, o.Entries[j])
			j++
		default:
			out.Entries = append(out.Entries, mergeEntry(t.Entries[i], o.Entries[j]))
			i++
			j++
		}
	}
	return out
}

// Normalize returns t with one entry per database, sorted by database
// name, as Decode and Merge return tokens: the entries of a database that
// t names more than once (a token built by hand) are merged by Merge's
// rule, so that the furthest position of one history is kept, and entries
// of different systems leave the database with the zero Epoch (it reads
// the primary). A token that is already normal is returned as it is,
// without allocating.
func (t Token) Normalize() Token {
	if t.Normal() {
		return t
	}
	entries := slices.Clone(t.Entries)
	slices.SortStableFunc(entries, func(a, b Entry) int { return strings.Compare(a.Database, b.Database) })
	out := entries[:1]
	for _, e := range entries[1:] {
		if last := &out[len(out)-1]; last.Database == e.Database {
			*last = mergeEntry(*last, e)
		} else {
			out = append(out, e)
		}
	}
	return Token{Entries: out, CapturedAt: t.CapturedAt}
}

// Normal reports whether t has at most one entry per database, sorted by
// database name (Normalize).
func (t Token) Normal() bool {
	for i := 1; i < len(t.Entries); i++ {
		if t.Entries[i-1].Database >= t.Entries[i].Database {
			return false
		}
	}
	return true
}

// With returns t merged with a single entry.
func (t Token) With(e Entry, capturedAt time.Time) Token {
	return t.Merge(Token{Entries: []Entry{e}, CapturedAt: capturedAt})
}

func mergeEntry(a, b Entry) Entry {
	out := a
	if b.LSN > a.LSN || (b.LSN == a.LSN && sourceRank(b.Source) > sourceRank(a.Source)) {
		out = b
	}
	switch {
	case a.Epoch == b.Epoch:
		// Same history: the larger LSN is already in out.
	case a.Epoch.IsZero() || b.Epoch.IsZero() || a.Epoch.SystemID != b.Epoch.SystemID:
		out.Epoch = Epoch{}
	default:
		out.Epoch = a.Epoch
		if b.Epoch.Timeline > a.Epoch.Timeline {
			out.Epoch = b.Epoch
		}
	}
	return out
}

// sourceRank breaks ties between equal LSNs deterministically (so Merge
// stays commutative), preferring the more specific origin.
func sourceRank(s Source) int {
	switch s {
	case SourcePrimary:
		return 3
	case SourceCDC:
		return 2
	case SourceReplica:
		return 1
	}
	return 0
}

func earliest(a, b time.Time) time.Time {
	switch {
	case a.IsZero():
		return b
	case b.IsZero():
		return a
	case b.Before(a):
		return b
	}
	return a
}

// Of builds a token from entries in any order; entries naming the same
// database are merged as Merge does.
func Of(capturedAt time.Time, entries ...Entry) Token {
	t := Token{CapturedAt: capturedAt}
	for _, e := range entries {
		t = t.Merge(Token{Entries: []Entry{e}})
	}
	return t
}
