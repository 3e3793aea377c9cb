package position

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
// position) is not decoded again and a repeated entry head (database,
// source, system identifier and timeline) is not parsed again, and it
// remembers the database names it has made, so that the same names cost
// no new strings. Only bytes identical to ones decoded before are taken
// from memory, so the answer is always DecodeHeaders's.
//
// The Token it returns shares its Entries with the decoder: it is valid
// until the next call of Decode. A caller that keeps it longer copies the
// entries (consume's Router keeps nothing of the tokens it routes, so a
// token decoded here may be routed directly). The zero HeaderDecoder is
// ready to use; it is not safe for concurrent use.
type HeaderDecoder struct {
	last    []byte // the value last decoded, a copy
	decoded bool   // last, tok and err hold a decoded value
	tok     Token
	err     error
	entries []Entry // tok's Entries
	names   nameCache
	memo    headMemo
}

// Decode returns the token of one HeaderName header value, as
// DecodeHeaders(string(value)) does: the zero Token and nil for an empty
// value, the zero Token and a *DecodeError for one that does not decode.
func (h *HeaderDecoder) Decode(value []byte) (Token, error) {
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
	tok, derr := decode(value, h.entries[:0], &h.names, &h.memo)
	h.last = append(h.last[:0], value...)
	h.decoded = true
	h.memo.prev = nil
	if derr != nil {
		h.memo.heads = h.memo.heads[:0] // they were the value before
		derr.Input = excerpt(value, derr.Offset)
		h.tok, h.err = Token{}, derr
		return h.tok, h.err
	}
	// The heads just recorded describe the value now in last.
	h.memo.heads, h.memo.next = h.memo.next, h.memo.heads
	h.entries = tok.Entries[:0]
	h.tok, h.err = tok, nil
	return tok, nil
}

// headMemo is what a HeaderDecoder remembers of the entry heads of the
// value it decoded last: where each lay in that value (prev, during a
// decode) and what it decoded to, LSN aside.
type headMemo struct {
	prev  []byte
	heads []entryHead // the last value's, in text order
	next  []entryHead // the value being decoded's
}

type entryHead struct {
	start, end int   // the head's bytes
	e          Entry // its database, source and epoch
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
