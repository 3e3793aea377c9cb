package position

import (
	"strconv"
)

// TimelineFromWALFileName reads the timeline from a WAL segment file name
// as pg_walfile_name() returns it: 24 hex digits, the first 8 of which are
// the timeline. On a primary this is how to learn the current timeline
// right after a promotion; pg_control_checkpoint() lags it until the next
// checkpoint.
func TimelineFromWALFileName(name string) (uint32, error) {
	if len(name) != 24 {
		return 0, &SyntaxError{What: "WAL file name", Input: name}
	}
	v, ok := parseHex(name[:8], 8)
	if !ok || v == 0 {
		return 0, &SyntaxError{What: "WAL file name", Input: name}
	}
	return uint32(v), nil
}

// ParseSystemIdentifier reads pg_control_system().system_identifier as
// text. The server's column is a bigint, so identifiers with the top bit
// set print negative; both forms are accepted and zero is rejected.
func ParseSystemIdentifier(s string) (uint64, error) {
	if v, err := strconv.ParseInt(s, 10, 64); err == nil && v != 0 {
		return uint64(v), nil
	}
	if v, err := strconv.ParseUint(s, 10, 64); err == nil && v != 0 {
		return v, nil
	}
	return 0, &SyntaxError{What: "system identifier", Input: s}
}
