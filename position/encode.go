package position

import (
	"strconv"
	"time"
)

// The text form, version 1:
//
//	v1;<captured>;<database>=<source>.<system id>.<timeline>.<lsn>[;<database>=...]
//
//	captured   Unix milliseconds in base 36 (0: unknown)
//	database   1 to 63 of [A-Za-z0-9_-]
//	source     p (primary write), r (replica read), c (CDC), u (unknown)
//	system id  1 to 16 hexadecimal digits
//	timeline   1 to 8 hexadecimal digits
//	lsn        "X/Y", each half 1 to 8 hexadecimal digits
//
// for example "v1;mi3v0q2k;main=p.6f1e2d3c4b5a6978.1.0/16B3740". Only
// printable ASCII without spaces, quotes, commas or backslashes is used, so
// the text is a valid HTTP header value, asynq header and Kafka header
// value without escaping. One database takes about 50 bytes.
const (
	// Version is the version Encode writes.
	Version = 1
	// HeaderName is the header that carries a token in asynq task headers,
	// Kafka message and record headers, outbox event headers and River job
	// metadata. The value is a valid HTTP header value too.
	HeaderName = "caughtup-token"
	// MaxEncodedLen bounds the text Decode accepts.
	MaxEncodedLen = 1024
	// MaxDatabases bounds the entries of one token.
	MaxDatabases = 16
	// MaxDatabaseNameLen bounds a database name.
	MaxDatabaseNameLen = 63
)

// ValidDatabaseName reports whether name can be carried in a token.
func ValidDatabaseName(name string) bool {
	if len(name) == 0 || len(name) > MaxDatabaseNameLen {
		return false
	}
	for i := 0; i < len(name); i++ {
		if !isNameByte(name[i]) {
			return false
		}
	}
	return true
}

func isNameByte(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-'
}

// Encode returns the token's text form. An empty token encodes as "" (send
// no header at all). Invalid database names, duplicate databases or too
// many entries return an error rather than a token that would be rejected
// downstream.
func (t Token) Encode() (string, error) {
	b, err := t.AppendText(nil)
	return string(b), err
}

// String is Encode for logs; an invalid token prints its error.
func (t Token) String() string {
	s, err := t.Encode()
	if err != nil {
		return "<" + err.Error() + ">"
	}
	return s
}

// AppendText appends the encoded token to b.
func (t Token) AppendText(b []byte) ([]byte, error) {
	if len(t.Entries) == 0 {
		return b, nil
	}
	if len(t.Entries) > MaxDatabases {
		return b, &DecodeError{Err: ErrTooLarge, Detail: "more than " + strconv.Itoa(MaxDatabases) + " databases"}
	}
	start := len(b)
	b = append(b, "v1;"...)
	ms := int64(0)
	if !t.CapturedAt.IsZero() && t.CapturedAt.UnixMilli() > 0 {
		ms = t.CapturedAt.UnixMilli()
	}
	b = strconv.AppendInt(b, ms, 36)
	for i, e := range t.Entries {
		if !ValidDatabaseName(e.Database) {
			return b[:start], &DecodeError{Err: ErrMalformed, Detail: "database name " + strconv.Quote(e.Database) + " must be 1-63 of [A-Za-z0-9_-]"}
		}
		for _, prev := range t.Entries[:i] {
			if prev.Database == e.Database {
				return b[:start], &DecodeError{Err: ErrDuplicateDatabase, Detail: strconv.Quote(e.Database)}
			}
		}
		b = append(b, ';')
		b = append(b, e.Database...)
		b = append(b, '=')
		src := e.Source
		if int(src) >= len(sourceCodes) {
			src = SourceUnknown
		}
		b = append(b, sourceCodes[src], '.')
		b = strconv.AppendUint(b, e.Epoch.SystemID, 16)
		b = append(b, '.')
		b = strconv.AppendUint(b, uint64(e.Epoch.Timeline), 16)
		b = append(b, '.')
		b, _ = e.LSN.AppendText(b)
	}
	if len(b)-start > MaxEncodedLen {
		return b[:start], &DecodeError{Err: ErrTooLarge, Detail: "encoded token longer than " + strconv.Itoa(MaxEncodedLen) + " bytes"}
	}
	return b, nil
}

// MarshalText implements encoding.TextMarshaler.
func (t Token) MarshalText() ([]byte, error) { return t.AppendText(nil) }

// UnmarshalText implements encoding.TextUnmarshaler. Empty text is the
// zero Token, which MarshalText writes, so a struct holding an unset Token
// round-trips through JSON.
func (t *Token) UnmarshalText(b []byte) error {
	if len(b) == 0 {
		*t = Token{}
		return nil
	}
	v, err := Decode(string(b))
	if err != nil {
		return err
	}
	*t = v
	return nil
}

// Decode parses a token's text form. It never panics; anything but a
// well-formed token of a known version returns a *DecodeError wrapping
// ErrMalformed, ErrUnknownVersion, ErrTooLarge or ErrDuplicateDatabase.
// Entries are returned sorted by database. The error's Input holds a
// bounded excerpt of s, so that a log line can show what the producer at
// fault sent.
func Decode(s string) (Token, error) {
	var t Token
	if err := decode(s, &t, nil, nil); err != nil {
		err.Input = excerpt(s, err.Offset)
		return Token{}, err
	}
	return t, nil
}

// maxExcerpt bounds DecodeError.Input.
const maxExcerpt = 64

// excerpt returns at most maxExcerpt bytes of s around offset, with "…"
// where it was cut.
func excerpt[S text](s S, offset int) string {
	if len(s) <= maxExcerpt {
		return string(s)
	}
	from := min(max(offset-maxExcerpt/2, 0), len(s)-maxExcerpt)
	out := string(s[from : from+maxExcerpt])
	if from > 0 {
		out = "…" + out
	}
	if from+maxExcerpt < len(s) {
		out += "…"
	}
	return out
}

// text is what decode reads: a header value as a string (Decode) or as
// the bytes a message carries (HeaderDecoder).
type text interface{ ~string | ~[]byte }

// decode parses s into t, reusing the array of t.Entries for the
// entries (nil: a new one); on failure t holds a part of the token. With
// names, database names are taken from it when their bytes match one seen
// before, and added to it otherwise; without, they are string(s[i:j]),
// which for a string s shares its bytes. With memo, the capture time and
// the heads of entries that repeat the value decoded before are taken
// from it (reuseTime, reuseHead), and this value's are recorded in it.
//
// A consumer decodes a token per record, hundreds of thousands a second,
// so decode is written to be cheap as well as strict. The offset is a
// local passed from one field's reader to the next, each returning where
// it stopped (on failure: the offset the error reports), rather than the
// field of a decoder struct the readers update through a pointer. The
// token is written where the caller keeps it and each entry in its slot,
// rather than built in locals and copied: a copy that reads 16 bytes at
// once right after they were written 8 at a time waits for the stores.
// The slots are not cleared first: every reader sets each field.
func decode[S text](s S, t *Token, names *nameCache, memo *headMemo) *DecodeError {
	if len(s) > MaxEncodedLen {
		return &DecodeError{Err: ErrTooLarge, Detail: strconv.Itoa(len(s)) + " bytes, at most " + strconv.Itoa(MaxEncodedLen)}
	}
	captured, i := memo.reuseTime()
	if i == 0 {
		var err *DecodeError
		if captured, i, err = readTime(s); err != nil {
			return err
		}
		if memo != nil {
			memo.timeEnd, memo.capturedAt = i, captured
		}
	}
	// Compared first: a HeaderDecoder's token mostly has this time
	// already, and storing it again (a location pointer) costs a write
	// barrier while the garbage collector runs.
	if t.CapturedAt != captured {
		t.CapturedAt = captured
	}
	if i >= len(s) {
		return malformed(i, "no database entries")
	}
	if t.Entries == nil {
		t.Entries = make([]Entry, 0, 1)
	}
	t.Entries = t.Entries[:0]
	for i < len(s) {
		n := len(t.Entries)
		if n == MaxDatabases {
			return &DecodeError{Offset: i, Err: ErrTooLarge, Detail: "more than " + strconv.Itoa(MaxDatabases) + " databases"}
		}
		if n < cap(t.Entries) {
			t.Entries = t.Entries[:n+1]
		} else {
			t.Entries = append(t.Entries, Entry{})
		}
		entries := t.Entries
		e := &entries[n]
		var err *DecodeError
		if i, err = readEntry(s, i, n, e, names, memo); err != nil {
			return err
		}
		// Insertion keeps entries sorted and finds duplicates; MaxDatabases
		// keeps it cheap.
		pos := n
		for pos > 0 && entries[pos-1].Database >= e.Database {
			if entries[pos-1].Database == e.Database {
				return &DecodeError{Offset: i, Err: ErrDuplicateDatabase, Detail: strconv.Quote(e.Database)}
			}
			pos--
		}
		if pos < n {
			moved := *e
			copy(entries[pos+1:], entries[pos:n])
			entries[pos] = moved
		}
	}
	return nil
}

// maxUnixMilli keeps time.UnixMilli far from overflow (year ~ 292 million).
const maxUnixMilli = 1 << 53

// malformed is the error of text that does not follow the grammar at
// offset.
func malformed(offset int, detail string) *DecodeError {
	return &DecodeError{Offset: offset, Err: ErrMalformed, Detail: detail}
}

// readTime reads "v<version>;<captured>;" and returns the capture time
// and the offset after it. Every token this build writes starts "v1;", so
// those three bytes are checked first; anything else (another version,
// "v01;", which reads as 1 as well) takes the general rule.
func readTime[S text](s S) (time.Time, int, *DecodeError) {
	i := len("v1;")
	if len(s) < 3 || s[0] != 'v' || s[1] != '1' || s[2] != ';' {
		var err *DecodeError
		if i, err = readVersion(s); err != nil {
			return time.Time{}, 0, err
		}
	}
	ms, i, ok := readUint(s, i, 36, 12, ';')
	if !ok || ms > maxUnixMilli {
		return time.Time{}, 0, malformed(i, "want capture time in base-36 milliseconds")
	}
	if ms == 0 {
		return time.Time{}, i, nil
	}
	return time.UnixMilli(int64(ms)), i, nil
}

// readVersion reads "v<version>;", 1 to 4 decimal digits, and returns the
// offset after it.
func readVersion[S text](s S) (int, *DecodeError) {
	if len(s) == 0 {
		return 0, malformed(0, "empty")
	}
	if s[0] != 'v' {
		return 0, malformed(1, `want "v<version>;"`)
	}
	ver, i, ok := readUint(s, 1, 10, 4, ';')
	if !ok {
		return 0, malformed(i, `want "v<version>;"`)
	}
	if ver != Version {
		return 0, &DecodeError{Offset: 1, Err: ErrUnknownVersion, Detail: "version " + strconv.FormatUint(ver, 10) + ", this build reads version 1"}
	}
	return i, nil
}

// readUint reads 1 to maxDigits digits in base from s[i:] up to term
// (consumed) or the end of s, and returns where it stopped: past the
// terminator or at the end, or on failure at the byte at fault (at i when
// there is no digit). Not strconv: it would need the field cut out first
// (a search for term), takes signs and prefixes this grammar does not,
// and its errors carry no offset.
func readUint[S text](s S, i int, base uint64, maxDigits int, term byte) (v uint64, end int, ok bool) {
	start := i
	for ; i < len(s) && s[i] != term; i++ {
		dv := uint64(digits[s[i]])
		if dv >= base || i-start >= maxDigits {
			return 0, i, false
		}
		v = v*base + dv
	}
	if i == start {
		return 0, i, false
	}
	if i < len(s) {
		i++ // terminator
	}
	return v, i, true
}

// digits holds each byte's value as a base-36 digit (case-insensitive),
// and noDigit for bytes that are none.
var digits = func() (t [256]uint8) {
	for c := range t {
		switch {
		case '0' <= c && c <= '9':
			t[c] = uint8(c - '0')
		case 'a' <= c && c <= 'z':
			t[c] = uint8(c-'a') + 10
		case 'A' <= c && c <= 'Z':
			t[c] = uint8(c-'A') + 10
		default:
			t[c] = noDigit
		}
	}
	return t
}()

// noDigit is above every base readUint reads.
const noDigit = 0xFF

// readLSN reads an entry's LSN at s[i:]: the text up to the next ';' or
// the end is "X/Y", each half 1 to 8 hexadecimal digits (as parseLSN reads
// it, in one pass). It returns where the LSN ends; on failure, i.
func readLSN[S text](s S, i int) (LSN, int, bool) {
	hi, j, ok := hexRun(s, i)
	if !ok || j >= len(s) || s[j] != '/' {
		return 0, i, false
	}
	lo, j, ok := hexRun(s, j+1)
	if !ok || j < len(s) && s[j] != ';' {
		return 0, i, false
	}
	return LSN(hi<<32 | lo), j, true
}

// hexRun reads the hexadecimal digits of s from i on, and reports where
// they end and whether there were 1 to maxHalfDigits of them.
func hexRun[S text](s S, i int) (v uint64, end int, ok bool) {
	start := i
	for ; i < len(s); i++ {
		dv := digits[s[i]]
		if dv >= 16 {
			break
		}
		v = v<<4 | uint64(dv)
	}
	return v, i, i > start && i-start <= maxHalfDigits
}

// readHead reads an entry's head at s[i:],
// "<database>=<source>.<system id>.<timeline>.", into e, and returns
// where it ends.
func readHead[S text](s S, i int, e *Entry, names *nameCache) (int, *DecodeError) {
	start := i
	for i < len(s) && isNameByte(s[i]) {
		i++
	}
	if i == start || i-start > MaxDatabaseNameLen {
		return 0, malformed(i, nameDetail)
	}
	if i >= len(s) || s[i] != '=' {
		return 0, malformed(past(s, i), nameDetail)
	}
	if names != nil {
		e.Database = intern(names, s[start:i])
	} else {
		e.Database = string(s[start:i])
	}
	i++ // '='
	switch {
	case i >= len(s):
		return 0, malformed(i, "want source p, r, c or u")
	case s[i] == 'p':
		e.Source = SourcePrimary
	case s[i] == 'r':
		e.Source = SourceReplica
	case s[i] == 'c':
		e.Source = SourceCDC
	case s[i] == 'u':
		e.Source = SourceUnknown
	default:
		return 0, malformed(i+1, "want source p, r, c or u")
	}
	i++
	if i >= len(s) || s[i] != '.' {
		return 0, malformed(past(s, i), `want "." after source`)
	}
	sys, i, ok := readUint(s, i+1, 16, 16, '.')
	if !ok || s[i-1] != '.' {
		return 0, malformed(i, "want system identifier as 1-16 hex digits")
	}
	tli, i, ok := readUint(s, i, 16, 8, '.')
	if !ok || s[i-1] != '.' {
		return 0, malformed(i, "want timeline as 1-8 hex digits")
	}
	e.Epoch = Epoch{SystemID: sys, Timeline: uint32(tli)}
	return i, nil
}

const nameDetail = "want <database>= with 1-63 of [A-Za-z0-9_-]"

// past is the offset a wrong single byte at i is reported at: after it,
// or the end when there is none.
func past[S text](s S, i int) int { return min(i+1, len(s)) }

// readEntry reads the j-th entry of the text at s[i:] into e and returns
// where the next begins. The readers of the fields return where they
// stopped, but on failure only the error's offset counts.
func readEntry[S text](s S, i, j int, e *Entry, names *nameCache, memo *headMemo) (int, *DecodeError) {
	start := i
	i, ok := reuseHead(memo, s, i, j, e)
	if !ok {
		var err *DecodeError
		if i, err = readHead(s, i, e, names); err != nil {
			return 0, err
		}
		if memo != nil {
			memo.record(j, entryHead{start: start, end: i, e: *e})
		}
	}
	lsn, i, ok := readLSN(s, i)
	if !ok {
		return 0, malformed(i, `want LSN "X/Y"`)
	}
	e.LSN = lsn
	if i < len(s) {
		i++ // ';'
		if i >= len(s) {
			return 0, malformed(i, "trailing ';'")
		}
	}
	return i, nil
}
