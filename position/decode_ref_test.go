package position

import (
	"strconv"
	"time"
)

// The decoder as it was before it was made faster (commit 38c5437's
// decode and HeaderDecoder, renamed and otherwise unchanged), kept as the
// reference the faster one is checked against: FuzzDecodeReference and
// FuzzHeaderDecoderReference compare their answers, errors and offsets
// included, on arbitrary inputs and sequences of inputs. Do not change it
// to follow the production code: its worth is that it is the old code.

// refDecode is the old Decode.
func refDecode(s string) (Token, error) {
	t, err := refDecodeText(s, nil, nil, nil)
	if err != nil {
		err.Input = refExcerpt(s, err.Offset)
		return Token{}, err
	}
	return t, nil
}

func refExcerpt[S text](s S, offset int) string {
	const maxExcerpt = 64
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

func refDecodeText[S text](s S, entries []Entry, names *refNameCache, memo *refHeadMemo) (Token, *DecodeError) {
	if len(s) > MaxEncodedLen {
		return Token{}, &DecodeError{Err: ErrTooLarge, Detail: strconv.Itoa(len(s)) + " bytes, at most " + strconv.Itoa(MaxEncodedLen)}
	}
	if len(s) == 0 {
		return Token{}, &DecodeError{Err: ErrMalformed, Detail: "empty"}
	}
	d := refDecoder[S]{s: s, names: names, memo: memo}
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
	if !ok || ms > 1<<53 {
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

type refDecoder[S text] struct {
	s     S
	pos   int
	names *refNameCache
	memo  *refHeadMemo
}

func (d *refDecoder[S]) done() bool { return d.pos >= len(d.s) }

func (d *refDecoder[S]) next() byte {
	if d.pos >= len(d.s) {
		return 0
	}
	c := d.s[d.pos]
	d.pos++
	return c
}

func (d *refDecoder[S]) fail(err error, detail string) *DecodeError {
	return &DecodeError{Offset: d.pos, Err: err, Detail: detail}
}

func (d *refDecoder[S]) uint(base uint64, maxDigits int, term byte) (uint64, bool) {
	s, start := d.s, d.pos
	i := start
	var v uint64
	for ; i < len(s) && s[i] != term; i++ {
		dv := uint64(refDigits[s[i]])
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

var refDigits = func() (t [256]uint8) {
	for c := range t {
		switch {
		case '0' <= c && c <= '9':
			t[c] = uint8(c - '0')
		case 'a' <= c && c <= 'z':
			t[c] = uint8(c-'a') + 10
		case 'A' <= c && c <= 'Z':
			t[c] = uint8(c-'A') + 10
		default:
			t[c] = 0xFF
		}
	}
	return t
}()

func (d *refDecoder[S]) lsn() (LSN, bool) {
	s, i := d.s, d.pos
	hi, i, ok := refHexRun(s, i)
	if !ok || i >= len(s) || s[i] != '/' {
		return 0, false
	}
	lo, i, ok := refHexRun(s, i+1)
	if !ok || i < len(s) && s[i] != ';' {
		return 0, false
	}
	d.pos = i
	return LSN(hi<<32 | lo), true
}

func refHexRun[S text](s S, i int) (v uint64, end int, ok bool) {
	start := i
	for ; i < len(s); i++ {
		dv := refDigits[s[i]]
		if dv >= 16 {
			break
		}
		v = v<<4 | uint64(dv)
	}
	return v, i, i > start && i-start <= 8
}

func refIsNameByte(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-'
}

func (d *refDecoder[S]) head(e *Entry) *DecodeError {
	s, start := d.s, d.pos
	i := start
	for i < len(s) && refIsNameByte(s[i]) {
		i++
	}
	d.pos = i
	if d.pos == start || d.pos-start > MaxDatabaseNameLen || d.next() != '=' {
		return d.fail(ErrMalformed, "want <database>= with 1-63 of [A-Za-z0-9_-]")
	}
	if d.names != nil {
		e.Database = refIntern(d.names, d.s[start:d.pos-1])
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

func (d *refDecoder[S]) reuseHead(j int, e *Entry) bool {
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
	m.next = append(m.next, refEntryHead{start: at, end: d.pos, e: h.e})
	return true
}

func (d *refDecoder[S]) entry(j int) (Entry, *DecodeError) {
	var e Entry
	start := d.pos
	if !d.reuseHead(j, &e) {
		if err := d.head(&e); err != nil {
			return e, err
		}
		if d.memo != nil {
			d.memo.next = append(d.memo.next, refEntryHead{start: start, end: d.pos, e: e})
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

// refHeaderDecoder is the old HeaderDecoder.
type refHeaderDecoder struct {
	last    []byte
	decoded bool
	tok     Token
	err     error
	entries []Entry
	names   refNameCache
	memo    refHeadMemo
}

func (h *refHeaderDecoder) Decode(value []byte) (Token, error) {
	if len(value) == 0 {
		return Token{}, nil
	}
	if h.decoded && string(value) == string(h.last) {
		return h.tok, h.err
	}
	h.memo.prev, h.memo.next = h.last, h.memo.next[:0]
	if !h.decoded {
		h.memo.heads = h.memo.heads[:0]
	}
	tok, derr := refDecodeText(value, h.entries[:0], &h.names, &h.memo)
	h.last = append(h.last[:0], value...)
	h.decoded = true
	h.memo.prev = nil
	if derr != nil {
		h.memo.heads = h.memo.heads[:0]
		derr.Input = refExcerpt(value, derr.Offset)
		h.tok, h.err = Token{}, derr
		return h.tok, h.err
	}
	h.memo.heads, h.memo.next = h.memo.next, h.memo.heads
	h.entries = tok.Entries[:0]
	h.tok, h.err = tok, nil
	return tok, nil
}

type refHeadMemo struct {
	prev  []byte
	heads []refEntryHead
	next  []refEntryHead
}

type refEntryHead struct {
	start, end int
	e          Entry
}

type refNameCache struct {
	names [MaxDatabases]string
	next  int
}

func refIntern[S text](c *refNameCache, name S) string {
	for _, n := range c.names {
		if len(n) == len(name) && string(name) == n {
			return n
		}
	}
	n := string(name)
	c.names[c.next%MaxDatabases] = n
	c.next++
	return n
}
