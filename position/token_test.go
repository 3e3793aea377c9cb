package position

import (
	"math/rand/v2"
	"reflect"
	"testing"
	"time"
)

const testSys = 7301234567890123456

var (
	t0  = time.UnixMilli(1_800_000_000_000)
	tl1 = Epoch{SystemID: testSys, Timeline: 1}
	tl2 = Epoch{SystemID: testSys, Timeline: 2}
)

func TestMergeKeepsFurthestPerDatabase(t *testing.T) {
	t.Parallel()
	a := Of(t0, Entry{Database: "main", Epoch: tl1, LSN: 0x200, Source: SourcePrimary},
		Entry{Database: "ci", Epoch: tl1, LSN: 0x10, Source: SourceReplica})
	b := Of(t0.Add(time.Second), Entry{Database: "main", Epoch: tl1, LSN: 0x100, Source: SourceReplica},
		Entry{Database: "sec", Epoch: tl1, LSN: 0x5, Source: SourcePrimary})
	got := a.Merge(b)
	want := Token{CapturedAt: t0, Entries: []Entry{
		{Database: "ci", Epoch: tl1, LSN: 0x10, Source: SourceReplica},
		{Database: "main", Epoch: tl1, LSN: 0x200, Source: SourcePrimary},
		{Database: "sec", Epoch: tl1, LSN: 0x5, Source: SourcePrimary},
	}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Merge =\n %+v\nwant\n %+v", got, want)
	}
	if !reflect.DeepEqual(b.Merge(a), want) {
		t.Fatal("Merge is not commutative")
	}
	if !reflect.DeepEqual(a.Merge(Token{}), a) || !reflect.DeepEqual(Token{}.Merge(a), a) {
		t.Fatal("the empty token is not Merge's identity")
	}
}

func TestMergeAcrossTimelinesAndSystems(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		a, b Entry
		want Entry
	}{
		{"later timeline wins, larger LSN kept",
			Entry{Database: "m", Epoch: tl1, LSN: 0x900, Source: SourcePrimary},
			Entry{Database: "m", Epoch: tl2, LSN: 0x500, Source: SourcePrimary},
			Entry{Database: "m", Epoch: tl2, LSN: 0x900, Source: SourcePrimary}},
		{"later timeline with the larger LSN",
			Entry{Database: "m", Epoch: tl1, LSN: 0x100, Source: SourceReplica},
			Entry{Database: "m", Epoch: tl2, LSN: 0x500, Source: SourcePrimary},
			Entry{Database: "m", Epoch: tl2, LSN: 0x500, Source: SourcePrimary}},
		{"different systems give an unknown epoch",
			Entry{Database: "m", Epoch: tl1, LSN: 0x100, Source: SourcePrimary},
			Entry{Database: "m", Epoch: Epoch{SystemID: 99, Timeline: 1}, LSN: 0x50, Source: SourcePrimary},
			Entry{Database: "m", LSN: 0x100, Source: SourcePrimary}},
		{"unknown epoch stays unknown",
			Entry{Database: "m", LSN: 0x100, Source: SourceCDC},
			Entry{Database: "m", Epoch: tl1, LSN: 0x50, Source: SourcePrimary},
			Entry{Database: "m", LSN: 0x100, Source: SourceCDC}},
		{"equal LSNs prefer the primary source",
			Entry{Database: "m", Epoch: tl1, LSN: 0x100, Source: SourceReplica},
			Entry{Database: "m", Epoch: tl1, LSN: 0x100, Source: SourcePrimary},
			Entry{Database: "m", Epoch: tl1, LSN: 0x100, Source: SourcePrimary}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ab := Token{Entries: []Entry{tt.a}}.Merge(Token{Entries: []Entry{tt.b}})
			ba := Token{Entries: []Entry{tt.b}}.Merge(Token{Entries: []Entry{tt.a}})
			if len(ab.Entries) != 1 || ab.Entries[0] != tt.want {
				t.Errorf("a.Merge(b) = %+v, want %+v", ab.Entries, tt.want)
			}
			if !reflect.DeepEqual(ab, ba) {
				t.Errorf("not commutative: %+v vs %+v", ab.Entries, ba.Entries)
			}
		})
	}
}

// The merged entry must never compare as caught up on a replica that one of
// the inputs would call behind: merging can only make a token stricter.
func TestMergeNeverLoosens(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	epochs := []Epoch{tl1, tl2, {SystemID: testSys, Timeline: 3}, {SystemID: 5, Timeline: 1}, {}}
	history := History{{Timeline: 1, Switchpoint: 0x800}, {Timeline: 2, Switchpoint: 0xC00}}
	for range 20000 {
		a := Entry{Database: "m", Epoch: epochs[rng.IntN(len(epochs))], LSN: LSN(rng.IntN(0x1000))}
		b := Entry{Database: "m", Epoch: epochs[rng.IntN(len(epochs))], LSN: LSN(rng.IntN(0x1000))}
		m := Token{Entries: []Entry{a}}.Merge(Token{Entries: []Entry{b}}).Entries[0]
		r := Replayed{Epoch: epochs[rng.IntN(len(epochs)-1)], LSN: LSN(rng.IntN(0x1000))}
		h := history[:rng.IntN(len(history)+1)]
		if m.Compare(r, h).Status != CaughtUp {
			continue
		}
		for _, in := range []Entry{a, b} {
			c := in.Compare(r, h)
			// An older-timeline input that cannot be placed (past its
			// switchpoint, or switchpoint unknown) is either in the shared
			// history, where the merged number covers it, or names WAL lost
			// at failover that no server of the new timeline has. The
			// merge requiring the new timeline to pass the same number is
			// safe either way. Anything else the merge calls caught up
			// must be caught up for each input.
			if c.Status == NotComparable && in.Epoch.SystemID == m.Epoch.SystemID &&
				in.Epoch.Timeline < m.Epoch.Timeline && (c.Reason == PastSwitchpoint || c.Reason == UnknownSwitchpoint) {
				continue
			}
			if c.Status != CaughtUp {
				t.Fatalf("merge of %+v and %+v is caught up on %+v (history %v) but %+v is %v/%v", a, b, r, h, in, c.Status, c.Reason)
			}
		}
	}
}

func TestOfMergesDuplicates(t *testing.T) {
	t.Parallel()
	tok := Of(t0, Entry{Database: "b", Epoch: tl1, LSN: 1}, Entry{Database: "a", Epoch: tl1, LSN: 2}, Entry{Database: "b", Epoch: tl1, LSN: 3})
	if len(tok.Entries) != 2 || tok.Entries[0].Database != "a" || tok.Entries[1].LSN != 3 {
		t.Fatalf("Of = %+v", tok.Entries)
	}
	if e, ok := tok.Entry("b"); !ok || e.LSN != 3 {
		t.Fatalf("Entry(b) = %+v, %v", e, ok)
	}
	if tok.Age(t0.Add(3*time.Second)) != 3*time.Second || (Token{}).Age(t0) != 0 {
		t.Fatal("Age")
	}
}

func TestNormalize(t *testing.T) {
	a := Entry{Database: "main", Epoch: tl1, LSN: 0x100, Source: SourcePrimary}
	b := Entry{Database: "main", Epoch: tl1, LSN: 0x300, Source: SourcePrimary}
	c := Entry{Database: "billing", Epoch: tl1, LSN: 0x50, Source: SourcePrimary}
	other := Entry{Database: "main", Epoch: Epoch{SystemID: testSys + 1, Timeline: 1}, LSN: 0x10, Source: SourcePrimary}

	normal := Of(t0, a, c)
	if !normal.Normal() || !reflect.DeepEqual(normal.Normalize(), normal) {
		t.Fatalf("Of's token is not normal: %+v", normal)
	}
	got := Token{Entries: []Entry{a, c, b}, CapturedAt: t0}.Normalize()
	if want := []Entry{c, b}; !reflect.DeepEqual(got.Entries, want) {
		t.Fatalf("Normalize = %+v, want %+v: one entry per database, the furthest", got.Entries, want)
	}
	got = Token{Entries: []Entry{a, other}}.Normalize()
	if len(got.Entries) != 1 || !got.Entries[0].Epoch.IsZero() {
		t.Fatalf("entries of two systems for one database = %+v, want one entry of the zero Epoch", got.Entries)
	}
	// Merge normalizes what it is given.
	if m := (Token{Entries: []Entry{b, a}}).Merge(Token{}); !reflect.DeepEqual(m.Entries, []Entry{b}) {
		t.Fatalf("Merge of a hand-built token = %+v", m.Entries)
	}
	if testing.AllocsPerRun(100, func() { normal.Normalize() }) != 0 {
		t.Fatal("Normalize of a normal token allocates")
	}
}
