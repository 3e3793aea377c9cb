package position

import (
	"encoding/binary"
	"math/bits"
	"time"
)

// The header codec: the one place that turns header values into a token
// and a token into a header value. Every stamper (asynq, kafka, outbox
// relays) and every reader (the consume router, the adapters) goes through
// these two functions, so one rule decides what an unreadable header means.

// MergeHeader returns the value of the HeaderName header that carries tok
// on top of existing, the value a task or message already has ("" when it
// has none):
//
//   - existing empty: tok encoded ("" for the zero Token: send no header).
//   - existing decodes: the two merged (Token.Merge), so the job waits for
//     every position either of them names.
//   - existing does not decode (malformed, or written by a newer version):
//     existing, unchanged, and tok is dropped. Unknown stays unknown: a
//     consumer cannot trust a header it cannot read, routes the job to the
//     primary and counts it, and the primary satisfies tok as well.
//     Replacing the unreadable value with tok alone could send the job to
//     a replica that lacks whatever the unreadable value stood for.
//
// The error is non-nil only when the merged token cannot be carried (more
// than MaxDatabases databases, an invalid database name): stampers return
// it at the call rather than send a header every consumer would reject.
func MergeHeader(existing string, tok Token) (string, error) {
	if tok.IsZero() {
		return existing, nil
	}
	if existing == "" {
		return tok.Encode()
	}
	prev, err := Decode(existing)
	if err != nil {
		return existing, nil
	}
	return prev.Merge(tok).Encode()
}

// MergeHeaderValues returns the one HeaderName value that stands for
// several (the repeated headers of a Kafka message, the tasks of an asynq
// group): "" for none (empty values are skipped), the tokens of all of
// them merged when every one decodes, else the first that does not decode,
// unchanged, by MergeHeader's rule: unknown stays unknown. The error is
// non-nil only when the merged token cannot be carried.
func MergeHeaderValues(values ...string) (string, error) {
	n, only := 0, ""
	for _, v := range values {
		if v != "" {
			n, only = n+1, v
		}
	}
	if n < 2 {
		return only, nil
	}
	tok, err := DecodeHeaders(values...)
	if err != nil {
		for _, v := range values {
			if v == "" {
				continue
			}
			if _, err := Decode(v); err != nil {
				return v, nil
			}
		}
	}
	return tok.Encode()
}

// DecodeHeaders returns the token carried by the values of a message's
// HeaderName headers. A header may repeat (Kafka allows it, and a message
// relayed by several stampers can collect more than one): the values are
// merged, as MergeHeader would have merged them. Empty values are skipped.
//
// No value (or only empty ones) returns the zero Token and nil: the job
// carries no token. If any value does not decode, DecodeHeaders returns
// the zero Token and that value's *DecodeError: one unreadable value makes
// the whole message unknown, whatever the others say, and the consumer
// reads the primary (consume.Job takes the pair as Token and TokenErr).
func DecodeHeaders(values ...string) (Token, error) {
	var tok Token
	for _, v := range values {
		if v == "" {
			continue
		}
		t, err := Decode(v)
		if err != nil {
			return Token{}, err
		}
		tok = tok.Merge(t)
	}
	return tok, nil
}

// A HeaderDecoder reads the token header of one message after another, as
// a consumer's loop does: DecodeHeaders of a single value given as the
// bytes a message carries, without allocating once it has seen the
// message's database names. Consecutive messages mostly carry tokens that
// differ only in their capture times and positions; the decoder remembers
// the last value and what it decoded to, so that a repeated value (the
// events of one transaction, an outbox relay's batch stamped with one
// position) is not decoded again and a repeated capture time or entry
// head (database, source, system identifier and timeline) is not parsed
// again, and it remembers the database names it has made, so that the
// same names cost no new strings. Only bytes identical to ones decoded
// before are taken from memory, so the answer is always DecodeHeaders's.
//
// The Token it returns shares its Entries with the decoder: it is valid
// until the next call of Decode. A caller that keeps it longer copies the
// entries (consume's Router keeps nothing of the tokens it routes, so a
// token decoded here may be routed directly). The zero HeaderDecoder is
// ready to use; it is not safe for concurrent use.
type HeaderDecoder struct {
	// tok and err are what memo.last decoded to. After an error tok
	// means nothing, but the array of its Entries is kept for the next.
	tok   Token
	err   error
	names nameCache
	memo  headMemo
}

// Decode returns the token of one HeaderName header value, as
// DecodeHeaders(string(value)) does: the zero Token and nil for an empty
// value, the zero Token and a *DecodeError for one that does not decode.
//
// A consumer's worker calls it for every record, often while the garbage
// collector runs, when every store of a pointer into the decoder (a slice,
// a string, a time's location) costs a write barrier; so what stays the
// same from value to value is left in place rather than stored again.
func (h *HeaderDecoder) Decode(value []byte) (Token, error) {
	if len(value) == 0 {
		return Token{}, nil
	}
	m := &h.memo
	m.same = commonPrefix(value, m.last)
	if m.same == len(value) && m.same == len(m.last) {
		if h.err != nil {
			return Token{}, h.err
		}
		return h.tok, nil
	}
	derr := decode(value, &h.tok, &h.names, m)
	m.keep(value)
	if derr != nil {
		m.forget() // part of it describes value, part the value before
		derr.Input = excerpt(value, derr.Offset)
		h.err = derr
		return Token{}, derr
	}
	if h.err != nil {
		h.err = nil
	}
	// Slots past the last entry were the value before's.
	m.heads = m.heads[:len(h.tok.Entries)]
	return h.tok, nil
}

// headMemo is what a HeaderDecoder remembers of the value it decoded last:
// the value, how long its version and capture time were and what the time
// decoded to, and where each entry head lay and what it decoded to, LSN
// aside. A decode overwrites the memo as it goes: the capture time before
// the first entry is read, and the j-th head once the j-th entry is read,
// after which the last value's j-th head is not looked at again. So a
// value whose heads repeat costs no copy of them.
type headMemo struct {
	last []byte // a copy; keep replaces it once a decode is done
	// same is how many bytes the value being decoded begins with that
	// last has too: memory is used without comparing bytes again where
	// they lie in this common prefix at the same offsets.
	same int
	// timeEnd is the offset after the ';' that ends last's capture time;
	// 0 when the memo holds nothing.
	timeEnd    int
	capturedAt time.Time
	heads      []entryHead // in text order
}

type entryHead struct {
	start, end int   // the head's bytes
	e          Entry // its database, source and epoch
}

// reuseTime takes the capture time from the memo (nil: none) when the
// value being decoded begins with the bytes the last value had up to the
// ';' after its capture time (consecutive records of a busy producer
// share the millisecond): readTime reads nothing past that ';', so the
// same bytes read the same. It returns the time and the offset after
// those bytes, or 0 if it did not.
func (m *headMemo) reuseTime() (time.Time, int) {
	if m == nil || m.timeEnd == 0 || m.same < m.timeEnd {
		return time.Time{}, 0
	}
	return m.capturedAt, m.timeEnd
}

// reuseHead takes the j-th entry's head from memo when the text at s[i:]
// repeats, byte for byte, the head the j-th entry of the last value had.
// readHead reads nothing past the head's final '.', so the same bytes read
// the same (offsets aside). It returns where the head ends and whether it
// did. e is the entry's slot, which mostly holds this very entry of the
// last value: its name is stored only if it differs (a write barrier).
func reuseHead[S text](m *headMemo, s S, i, j int, e *Entry) (int, bool) {
	if m == nil || j >= len(m.heads) {
		return i, false
	}
	h := &m.heads[j]
	n := h.end - h.start
	// At the same offset within the common prefix, the bytes are known
	// to be the same; elsewhere (an earlier field changed length) they
	// are compared.
	if i != h.start || m.same < h.end {
		if len(s)-i < n || string(s[i:i+n]) != string(m.last[h.start:h.end]) {
			return i, false
		}
	}
	if e.Database != h.e.Database {
		e.Database = h.e.Database
	}
	e.Epoch, e.Source = h.e.Epoch, h.e.Source
	h.start, h.end = i, i+n // now the head of this value's j-th entry
	return h.end, true
}

// record makes h the j-th head of the memo, which holds j or more (one
// for each entry read before).
func (m *headMemo) record(j int, h entryHead) {
	if j < len(m.heads) {
		m.heads[j] = h
		return
	}
	m.heads = append(m.heads, h)
}

// keep makes value the last value. Only the bytes after the common prefix
// are copied, into the array last has when it is large enough: a slice
// cut from itself is stored without a write barrier, an append's result
// with one.
func (m *headMemo) keep(value []byte) {
	if len(value) > cap(m.last) {
		m.last = append(m.last[:m.same], value[m.same:]...)
		return
	}
	m.last = m.last[:len(value)]
	copy(m.last[m.same:], value[m.same:])
}

// commonPrefix returns the length of the longest common prefix of a and
// b. It compares eight bytes at a time: the tokens of consecutive records
// mostly differ only in their last few bytes (the LSN), so this one pass
// finds a repeated value, capture time and first entry head, where a
// byte-by-byte loop or a comparison of each part would cost more.
func commonPrefix(a, b []byte) int {
	n := min(len(a), len(b))
	a, b = a[:n], b[:n]
	i := 0
	for ; i+8 <= n; i += 8 {
		if x := binary.LittleEndian.Uint64(a[i:]) ^ binary.LittleEndian.Uint64(b[i:]); x != 0 {
			return i + bits.TrailingZeros64(x)/8 // the first byte that differs
		}
	}
	if i == n {
		return n
	}
	if n >= 8 {
		// The last eight bytes, overlapping some found equal: the first
		// that differs lies past those.
		if x := binary.LittleEndian.Uint64(a[n-8:]) ^ binary.LittleEndian.Uint64(b[n-8:]); x != 0 {
			return n - 8 + bits.TrailingZeros64(x)/8
		}
		return n
	}
	for i < n && a[i] == b[i] {
		i++
	}
	return i
}

// forget empties the memo but for last.
func (m *headMemo) forget() {
	m.timeEnd = 0
	m.heads = m.heads[:0]
}

// nameCache holds database names decoded before, so that decoding the
// same bytes again takes the string already made. It keeps the last
// MaxDatabases distinct names.
type nameCache struct {
	names [MaxDatabases]string
	next  int
}

// intern returns name as a string: one the cache holds if its bytes are
// the same, else a new one, which the cache keeps in place of its oldest.
func intern[S text](c *nameCache, name S) string {
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
