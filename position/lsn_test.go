package position

import (
	"errors"
	"testing"
)

func TestParseLSN(t *testing.T) {
	t.Parallel()
	good := map[string]LSN{
		"0/0":               0,
		"0/16B3740":         0x16B3740,
		"16/B374D848":       0x16_B374D848,
		"ffffffff/FFFFFFFF": ^LSN(0),
		"1/0":               1 << 32,
	}
	for in, want := range good {
		got, err := ParseLSN(in)
		if err != nil || got != want {
			t.Errorf("ParseLSN(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "/", "0/", "/0", "0x1/0", "1/2/3", "g/0", "0/-1", " 0/1", "0/1 ", "100000000/0", "0/100000000", "+1/0", "0/1\x00"} {
		_, err := ParseLSN(in)
		var se *SyntaxError
		if !errors.As(err, &se) {
			t.Errorf("ParseLSN(%q) error = %v; want *SyntaxError", in, err)
		}
	}
}

func TestLSNStringRoundTrip(t *testing.T) {
	t.Parallel()
	for _, l := range []LSN{0, 1, 0x16B3740, 0xA_0000000F, ^LSN(0)} {
		s := l.String()
		back, err := ParseLSN(s)
		if err != nil || back != l {
			t.Errorf("%d: %q parsed back to %v, %v", uint64(l), s, back, err)
		}
	}
	if got := LSN(0x16_B374D848).String(); got != "16/B374D848" {
		t.Errorf("String() = %q, want the server's upper-case form", got)
	}
}

// Text comparison of LSNs is the classic bug: "9/0" sorts after "10/0".
func TestLSNCompareIsNumeric(t *testing.T) {
	t.Parallel()
	a, b := MustParseLSN("9/0"), MustParseLSN("10/0")
	if a.Compare(b) != -1 || b.Compare(a) != 1 || a.Compare(a) != 0 {
		t.Fatalf("Compare is not numeric: %v vs %v", a, b)
	}
	if d := b.Distance(a); d != 7<<32 {
		t.Errorf("Distance = %d, want %d", d, uint64(7)<<32)
	}
	if d := a.Distance(b); d != 7<<32 {
		t.Errorf("Distance is not symmetric: %d", d)
	}
	if a.BytesBefore(b) != 7<<32 || b.BytesBefore(a) != 0 {
		t.Errorf("BytesBefore = %d, %d", a.BytesBefore(b), b.BytesBefore(a))
	}
}

func TestParseHistory(t *testing.T) {
	t.Parallel()
	h, err := ParseHistory("1\t0/3000158\tno recovery target specified\n\n2\t0/5000000\tbefore 2026-01-01\n")
	if err != nil {
		t.Fatal(err)
	}
	if sp, ok := h.Switchpoint(1); !ok || sp != 0x3000158 {
		t.Errorf("Switchpoint(1) = %v, %v", sp, ok)
	}
	if sp, ok := h.Switchpoint(2); !ok || sp != 0x5000000 {
		t.Errorf("Switchpoint(2) = %v, %v", sp, ok)
	}
	if _, ok := h.Switchpoint(3); ok {
		t.Error("Switchpoint(3) found in a history that ends at 2")
	}
	for _, bad := range []string{"x\t0/1\tr", "1\tzz\tr", "1", "0\t0/1\tr"} {
		if _, err := ParseHistory(bad); err == nil {
			t.Errorf("ParseHistory(%q) accepted", bad)
		}
	}
}
