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
	t, err := decode(s, nil, nil, nil)
	if err != nil {
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

// decode parses s, appending the token's entries to entries (nil: a new
// slice). With names, database names are taken from it when their bytes
// match one seen before, and added to it otherwise; without, they are
// string(s[i:j]), which for a string s shares its bytes. With memo, the
// heads of entries that repeat the value decoded before are taken from it
// (reuseHead), and this value's are recorded in memo.next.
func decode[S text](s S, entries []Entry, names *nameCache, memo *headMemo) (Token, *DecodeError) {
	if len(s) > MaxEncodedLen {
		return Token{}, &DecodeError{Err: ErrTooLarge, Detail: strconv.Itoa(len(s)) + " bytes, at most " + strconv.Itoa(MaxEncodedLen)}
	}
	if len(s) == 0 {
		return Token{}, &DecodeError{Err: ErrMalformed, Detail: "empty"}
	}
	d := decoder[S]{s: s, names: names, memo: memo}
	if d.next() != 'v' {
		return Token{}, d.fail(ErrMalformed, `want "v<version>;"`)
	}
	ver, ok := d.uint(10, 4, ';')
	if !ok {
		return Token{}, d.fail(ErrMalformed, `want "v<version>;"`)
	}
	if ver != Version {
		return Token{}, &DecodeError{Offset: 1, Err: ErrUnknownVersion, Detail: "version " + strconv.FormatUint(ver, 10) + ", this build reads version 1"}
	}
	ms, ok := d.uint(36, 12, ';')
	if !ok || ms > maxUnixMilli {
		return Token{}, d.fail(ErrMalformed, "want capture time in base-36 milliseconds")
	}
	var t Token
	if ms > 0 {
		t.CapturedAt = time.UnixMilli(int64(ms))
	}
	if d.done() {
		return Token{}, d.fail(ErrMalformed, "no database entries")
	}
	if entries == nil {
		entries = make([]Entry, 0, 1)
	}
	t.Entries = entries[:0]
	for !d.done() {
		if len(t.Entries) == MaxDatabases {
			return Token{}, d.fail(ErrTooLarge, "more than "+strconv.Itoa(MaxDatabases)+" databases")
		}
		e, err := d.entry(len(t.Entries))
		if err != nil {
			return Token{}, err
		}
		// Insertion keeps entries sorted and finds duplicates; MaxDatabases
		// keeps it cheap.
		pos := len(t.Entries)
		for pos > 0 && t.Entries[pos-1].Database >= e.Database {
			if t.Entries[pos-1].Database == e.Database {
				return Token{}, d.fail(ErrDuplicateDatabase, strconv.Quote(e.Database))
			}
			pos--
		}
		if pos == len(t.Entries) {
			t.Entries = append(t.Entries, e)
			continue
		}
		t.Entries = append(t.Entries, Entry{})
		copy(t.Entries[pos+1:], t.Entries[pos:])
		t.Entries[pos] = e
	}
	return t, nil
}

// maxUnixMilli keeps time.UnixMilli far from overflow (year ~ 292 million).
const maxUnixMilli = 1 << 53

type decoder[S text] struct {
	s     S
	pos   int
	names *nameCache
	memo  *headMemo
}

func (d *decoder[S]) done() bool { return d.pos >= len(d.s) }

func (d *decoder[S]) next() byte {
	if d.pos >= len(d.s) {
		return 0
	}
	c := d.s[d.pos]
	d.pos++
	return c
}

func (d *decoder[S]) fail(err error, detail string) *DecodeError {
	return &DecodeError{Offset: d.pos, Err: err, Detail: detail}
}

// uint reads 1..maxDigits digits in base up to the terminator (consumed) or
// the end of input.
// On failure d.pos is at the byte at fault. Locals rather than d's fields
// in the loop: tokens are decoded once per consumed message.
func (d *decoder[S]) uint(base uint64, maxDigits int, term byte) (uint64, bool) {
	s, start := d.s, d.pos
	i := start
	var v uint64
	for ; i < len(s) && s[i] != term; i++ {
		dv := uint64(digits[s[i]])
		if dv >= base || i-start >= maxDigits {
			d.pos = i
			return 0, false
		}
		v = v*base + dv
	}
	d.pos = i
	if i == start {
		return 0, false
	}
	if i < len(s) {
		d.pos++ // terminator
	}
	return v, true
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

// noDigit is above every base uint reads.
const noDigit = 0xFF

// lsn reads the entry's LSN: the text up to the next ';' or the end is
// "X/Y", each half 1 to 8 hexadecimal digits (as parseLSN reads it, in
// one pass). On failure d.pos stays at the LSN's start.
func (d *decoder[S]) lsn() (LSN, bool) {
	s, i := d.s, d.pos
	hi, i, ok := hexRun(s, i)
	if !ok || i >= len(s) || s[i] != '/' {
		return 0, false
	}
	lo, i, ok := hexRun(s, i+1)
	if !ok || i < len(s) && s[i] != ';' {
		return 0, false
	}
	d.pos = i
	return LSN(hi<<32 | lo), true
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

// head reads an entry's head: "<database>=<source>.<system id>.<timeline>."
// into e.
func (d *decoder[S]) head(e *Entry) *DecodeError {
	s, start := d.s, d.pos
	i := start
	for i < len(s) && isNameByte(s[i]) {
		i++
	}
	d.pos = i
	if d.pos == start || d.pos-start > MaxDatabaseNameLen || d.next() != '=' {
		return d.fail(ErrMalformed, "want <database>= with 1-63 of [A-Za-z0-9_-]")
	}
	if d.names != nil {
		e.Database = intern(d.names, d.s[start:d.pos-1])
	} else {
		e.Database = string(d.s[start : d.pos-1])
	}
	switch d.next() {
	case 'p':
		e.Source = SourcePrimary
	case 'r':
		e.Source = SourceReplica
	case 'c':
		e.Source = SourceCDC
	case 'u':
		e.Source = SourceUnknown
	default:
		return d.fail(ErrMalformed, "want source p, r, c or u")
	}
	if d.next() != '.' {
		return d.fail(ErrMalformed, `want "." after source`)
	}
	sys, ok := d.uint(16, 16, '.')
	if !ok || d.s[d.pos-1] != '.' {
		return d.fail(ErrMalformed, "want system identifier as 1-16 hex digits")
	}
	tli, ok := d.uint(16, 8, '.')
	if !ok || d.s[d.pos-1] != '.' {
		return d.fail(ErrMalformed, "want timeline as 1-8 hex digits")
	}
	e.Epoch = Epoch{SystemID: sys, Timeline: uint32(tli)}
	return nil
}

// reuseHead takes the j-th entry's head from the memo when the text at
// d.pos repeats, byte for byte, the head the j-th entry of the value
// decoded before had. head reads nothing past the head's final '.', so
// the same bytes read the same (offsets aside). It reports whether it
// did, having advanced d.pos past the head.
func (d *decoder[S]) reuseHead(j int, e *Entry) bool {
	m := d.memo
	if m == nil || j >= len(m.heads) {
		return false
	}
	h := &m.heads[j]
	seg := m.prev[h.start:h.end]
	s, at := d.s, d.pos
	if len(s)-at < len(seg) || string(s[at:at+len(seg)]) != string(seg) {
		return false
	}
	*e = h.e
	d.pos = at + len(seg)
	m.next = append(m.next, entryHead{start: at, end: d.pos, e: h.e})
	return true
}

// entry reads the j-th entry of the text.
func (d *decoder[S]) entry(j int) (Entry, *DecodeError) {
	var e Entry
	start := d.pos
	if !d.reuseHead(j, &e) {
		if err := d.head(&e); err != nil {
			return e, err
		}
		if d.memo != nil {
			d.memo.next = append(d.memo.next, entryHead{start: start, end: d.pos, e: e})
		}
	}
	lsn, ok := d.lsn()
	if !ok {
		return e, d.fail(ErrMalformed, `want LSN "X/Y"`)
	}
	e.LSN = lsn
	if d.pos < len(d.s) {
		d.pos++ // ';'
		if d.done() {
			return e, d.fail(ErrMalformed, "trailing ';'")
		}
	}
	return e, nil
}
