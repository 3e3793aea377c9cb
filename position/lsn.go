package position

import (
	"strconv"
)

// LSN is a PostgreSQL write-ahead log position: a byte offset into the
// WAL stream, printed by the server as two hexadecimal halves "X/Y".
//
// LSNs are compared as integers. Comparing their text is wrong ("9/0" >
// "10/0" as strings), which is why every comparison in caughtup goes through
// this type.
type LSN uint64

// InvalidLSN is the zero position, which PostgreSQL uses for "none".
const InvalidLSN LSN = 0

// maxHalfDigits is the widest half PostgreSQL prints: each half is a
// uint32, so at most eight hex digits.
const maxHalfDigits = 8

// ParseLSN parses the server's "X/Y" form, where X and Y are 1 to 8
// hexadecimal digits. Malformed text returns a *SyntaxError.
func ParseLSN(s string) (LSN, error) {
	l, ok := parseLSN(s)
	if !ok {
		return 0, &SyntaxError{What: "LSN", Input: s}
	}
	return l, nil
}

// MustParseLSN is ParseLSN for constants in tests and examples; it panics
// on malformed input.
func MustParseLSN(s string) LSN {
	l, err := ParseLSN(s)
	if err != nil {
		panic(err)
	}
	return l
}

func parseLSN[S text](s S) (LSN, bool) {
	slash := -1
	for i := 0; i < len(s); i++ {
		if s[i] == '/' {
			slash = i
			break
		}
	}
	if slash < 0 {
		return 0, false
	}
	hi, ok := parseHex(s[:slash], maxHalfDigits)
	if !ok {
		return 0, false
	}
	lo, ok := parseHex(s[slash+1:], maxHalfDigits)
	if !ok {
		return 0, false
	}
	return LSN(hi<<32 | lo), true
}

// parseHex accepts 1..maxDigits hexadecimal digits and nothing else (no
// sign, no prefix, no spaces), so every accepted text has one meaning.
func parseHex[S text](s S, maxDigits int) (uint64, bool) {
	if len(s) == 0 || len(s) > maxDigits {
		return 0, false
	}
	var v uint64
	for i := 0; i < len(s); i++ {
		d := digits[s[i]]
		if d >= 16 {
			return 0, false
		}
		v = v<<4 | uint64(d)
	}
	return v, true
}

// String prints the position the way PostgreSQL does, e.g. "16/B374D848".
func (l LSN) String() string {
	b, _ := l.AppendText(make([]byte, 0, 17))
	return string(b)
}

// AppendText appends the "X/Y" form to b.
func (l LSN) AppendText(b []byte) ([]byte, error) {
	start := len(b)
	b = strconv.AppendUint(b, uint64(l)>>32, 16)
	b = append(b, '/')
	b = strconv.AppendUint(b, uint64(l)&0xFFFFFFFF, 16)
	upperHex(b[start:])
	return b, nil
}

// upperHex upper-cases hex digits in place to match the server's output.
func upperHex(b []byte) {
	for i, c := range b {
		if 'a' <= c && c <= 'f' {
			b[i] = c - 'a' + 'A'
		}
	}
}

// MarshalText implements encoding.TextMarshaler ("X/Y").
func (l LSN) MarshalText() ([]byte, error) { return l.AppendText(nil) }

// UnmarshalText implements encoding.TextUnmarshaler.
func (l *LSN) UnmarshalText(b []byte) error {
	v, err := ParseLSN(string(b))
	if err != nil {
		return err
	}
	*l = v
	return nil
}

// Compare returns -1, 0 or +1 as l is before, at or after o.
func (l LSN) Compare(o LSN) int {
	switch {
	case l < o:
		return -1
	case l > o:
		return 1
	}
	return 0
}

// Distance is the number of WAL bytes between l and o, whichever is
// larger (PostgreSQL's abs(pg_wal_lsn_diff(l, o))).
func (l LSN) Distance(o LSN) uint64 {
	if l >= o {
		return uint64(l - o)
	}
	return uint64(o - l)
}

// BytesBefore is how many WAL bytes l still has to advance to reach
// target; 0 once l >= target. It is the "behind by N bytes" of a replica
// whose replay position is l.
func (l LSN) BytesBefore(target LSN) uint64 {
	if l >= target {
		return 0
	}
	return uint64(target - l)
}
