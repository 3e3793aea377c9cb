package position

import "testing"

func TestEntryCompare(t *testing.T) {
	t.Parallel()
	const sys = 7301234567890123456
	tl1 := Epoch{SystemID: sys, Timeline: 1}
	tl2 := Epoch{SystemID: sys, Timeline: 2}
	tl3 := Epoch{SystemID: sys, Timeline: 3}
	// Timeline 1 ended at 0/5000000 (promotion to 2), 2 at 0/9000000 (to 3).
	history := History{{Timeline: 1, Switchpoint: 0x5000000}, {Timeline: 2, Switchpoint: 0x9000000}}

	tests := []struct {
		name    string
		entry   Entry
		replica Replayed
		history History
		want    Comparison
	}{
		{"same epoch, replayed exactly", Entry{Epoch: tl1, LSN: 0x100}, Replayed{tl1, 0x100}, nil, Comparison{Status: CaughtUp}},
		{"same epoch, replayed past", Entry{Epoch: tl1, LSN: 0x100}, Replayed{tl1, 0x200}, nil, Comparison{Status: CaughtUp}},
		{"same epoch, behind", Entry{Epoch: tl1, LSN: 0x300}, Replayed{tl1, 0x200}, nil, Comparison{Status: Behind, BytesBehind: 0x100}},
		{"numeric not textual", Entry{Epoch: tl1, LSN: MustParseLSN("A/0")}, Replayed{tl1, MustParseLSN("9/FFFFFFFF")}, nil, Comparison{Status: Behind, BytesBehind: 1}},
		{"other system", Entry{Epoch: Epoch{SystemID: 42, Timeline: 1}, LSN: 1}, Replayed{tl1, 0x200}, nil, Comparison{Reason: OtherSystem}},
		{"unknown token epoch", Entry{LSN: 1}, Replayed{tl1, 0x200}, nil, Comparison{Reason: UnknownEpoch}},
		{"unknown replica epoch", Entry{Epoch: tl1, LSN: 1}, Replayed{Epoch{SystemID: sys}, 0x200}, nil, Comparison{Reason: UnknownEpoch}},
		{"token on newer timeline", Entry{Epoch: tl2, LSN: 1}, Replayed{tl1, 0x200}, history, Comparison{Reason: NewerTimeline}},
		{"older timeline, no history", Entry{Epoch: tl1, LSN: 1}, Replayed{tl2, 0x6000000}, nil, Comparison{Reason: UnknownSwitchpoint}},
		{"older timeline below switchpoint, caught up", Entry{Epoch: tl1, LSN: 0x4000000}, Replayed{tl2, 0x6000000}, history, Comparison{Status: CaughtUp}},
		{"older timeline at switchpoint", Entry{Epoch: tl1, LSN: 0x5000000}, Replayed{tl2, 0x5000000}, history, Comparison{Status: CaughtUp}},
		{"older timeline below switchpoint, behind", Entry{Epoch: tl1, LSN: 0x4000000}, Replayed{tl2, 0x3000000}, history, Comparison{Status: Behind, BytesBehind: 0x1000000}},
		// The case a plain numeric comparison gets wrong: the replica is
		// numerically past the token, but the write was lost at failover.
		{"older timeline past switchpoint", Entry{Epoch: tl1, LSN: 0x5000001}, Replayed{tl2, 0x8000000}, history, Comparison{Reason: PastSwitchpoint}},
		{"grandparent timeline below its switchpoint", Entry{Epoch: tl1, LSN: 0x4000000}, Replayed{tl3, 0xA000000}, history, Comparison{Status: CaughtUp}},
		{"parent timeline past its switchpoint", Entry{Epoch: tl2, LSN: 0x9000010}, Replayed{tl3, 0xA000000}, history, Comparison{Reason: PastSwitchpoint}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := tt.entry.Compare(tt.replica, tt.history)
			if got != tt.want {
				t.Errorf("Compare = %+v (%v, %v), want %+v", got, got.Status, got.Reason, tt.want)
			}
		})
	}
}

func BenchmarkCompare(b *testing.B) {
	e := Entry{Database: "main", Epoch: Epoch{SystemID: 7301234567890123456, Timeline: 2}, LSN: 0x16B3740}
	r := Replayed{Epoch: e.Epoch, LSN: 0x16B3750}
	h := History{{Timeline: 1, Switchpoint: 0x100}}
	b.ReportAllocs()
	var n int
	for b.Loop() {
		if e.Compare(r, h).Status == CaughtUp {
			n++
		}
	}
	if n == 0 {
		b.Fatal("never caught up")
	}
}
