package position

import "testing"

func eq(t *testing.T, want, got LSN, msg ...string) {
	t.Helper()
	if want != got {
		t.Errorf("%v: got %v, want %v", msg, got, want)
	}
}

func TestWALLayoutInsertEnd(t *testing.T) {
	t.Parallel()
	l := WALLayout{MaxAlign: 8, BlockSize: 8192, SegmentSize: 16 << 20}
	for in, want := range map[string]string{
		"0/6000028":  "0/6000000", // after a WAL switch: long header of a segment's first page
		"0/6002018":  "0/6002000", // the last record ended at a page boundary
		"1/FF01E018": "1/FF01E000",
		"0/6000030":  "0/6000030", // a record ends 8 bytes into the segment's first page
		"0/6000018":  "0/6000018", // inside the long header: never an insert position, left alone
		"0/6002020":  "0/6002020",
		"0/16B3740":  "0/16B3740",
		"0/0":        "0/0",
	} {
		eq(t, MustParseLSN(want), l.InsertEnd(MustParseLSN(in)), in)
	}
	// Other geometries follow pg_control_init().
	big := WALLayout{MaxAlign: 8, BlockSize: 32768, SegmentSize: 64 << 20}
	eq(t, MustParseLSN("0/4008000"), big.InsertEnd(MustParseLSN("0/4008018")))
	eq(t, MustParseLSN("0/4002018"), big.InsertEnd(MustParseLSN("0/4002018")))
	// Unknown or unusual layouts are left alone: late, never early.
	for _, odd := range []WALLayout{{}, {MaxAlign: 4, BlockSize: 8192, SegmentSize: 16 << 20}, {MaxAlign: 8, BlockSize: 3000, SegmentSize: 16 << 20}} {
		eq(t, MustParseLSN("0/6000028"), odd.InsertEnd(MustParseLSN("0/6000028")))
	}
}
