package position

import "testing"

func TestTimelineFromWALFileName(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]uint32{"000000010000000000000003": 1, "0000000A00000001000000FF": 10, "FFFFFFFF0000000000000000": ^uint32(0)} {
		if got, err := TimelineFromWALFileName(in); err != nil || got != want {
			t.Errorf("TimelineFromWALFileName(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "00000001", "000000000000000000000003", "0000000g0000000000000003", "0000000100000000000000031"} {
		if _, err := TimelineFromWALFileName(bad); err == nil {
			t.Errorf("TimelineFromWALFileName(%q) accepted", bad)
		}
	}
}

func TestParseSystemIdentifier(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]uint64{"7301234567890123456": 7301234567890123456, "-1": ^uint64(0), "18446744073709551615": ^uint64(0)} {
		if got, err := ParseSystemIdentifier(in); err != nil || got != want {
			t.Errorf("ParseSystemIdentifier(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "0", "x", "1.5", "18446744073709551616"} {
		if _, err := ParseSystemIdentifier(bad); err == nil {
			t.Errorf("ParseSystemIdentifier(%q) accepted", bad)
		}
	}
}
