package kafka

import (
	"fmt"
	"strconv"

	"github.com/caughtup/caughtup/position"
)

// Headers the consumers write on records they republish, besides the
// token (position.HeaderName), which is copied unchanged. Numbers are
// decimal text. Each adapter exports them under its own names.
const (
	// HeaderDue is when a republished record may run, in Unix
	// milliseconds.
	HeaderDue = "caughtup-due"
	// HeaderDeferred ("1") marks a record republished because no replica
	// had replayed its token, rather than after a handler error.
	HeaderDeferred = "caughtup-deferred"
	// HeaderAttempts counts the handler's failed attempts so far.
	HeaderAttempts = "caughtup-attempts"
	// HeaderOriginTopic, HeaderOriginPartition and HeaderOriginOffset name
	// where the record was first consumed from.
	HeaderOriginTopic     = "caughtup-origin-topic"
	HeaderOriginPartition = "caughtup-origin-partition"
	HeaderOriginOffset    = "caughtup-origin-offset"
	// HeaderError is the last handler error, on dead-lettered records,
	// cut to MaxErrorHeader bytes.
	HeaderError = "caughtup-error"
)

// MaxErrorHeader bounds the error text written on a dead letter.
const MaxErrorHeader = 1024

// Header is either client's header type.
type Header interface {
	~struct {
		Key   string
		Value []byte
	}
}

// raw is the fields of a Header.
type raw = struct {
	Key   string
	Value []byte
}

func mk[H Header](key string, value []byte) H { return H(raw{Key: key, Value: value}) }

// Has reports whether hs has a header key.
func Has[H Header](hs []H, key string) bool {
	for i := range hs {
		if raw(hs[i]).Key == key {
			return true
		}
	}
	return false
}

// Get returns the value of the first header key, or "".
func Get[H Header](hs []H, key string) string {
	for i := range hs {
		if h := raw(hs[i]); h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// Set returns hs without its headers key, plus one of value, in a new
// slice.
func Set[H Header](hs []H, key, value string) []H {
	out := make([]H, 0, len(hs)+1)
	for i := range hs {
		if raw(hs[i]).Key != key {
			out = append(out, hs[i])
		}
	}
	return append(out, mk[H](key, []byte(value)))
}

// Keys returns the header names.
func Keys[H Header](hs []H) []string {
	keys := make([]string, len(hs))
	for i := range hs {
		keys[i] = raw(hs[i]).Key
	}
	return keys
}

// Int returns the last header key as a decimal integer.
func Int[H Header](hs []H, key string) (int64, bool) {
	for i := len(hs) - 1; i >= 0; i-- {
		if h := raw(hs[i]); h.Key == key {
			n, err := strconv.ParseInt(string(h.Value), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// Missing returns fields (tracing.Fields) as headers hs lacks.
func Missing[H Header](hs []H, fields map[string]string) []H {
	var out []H
	for k, v := range fields {
		if !Has(hs, k) {
			out = append(out, mk[H](k, []byte(v)))
		}
	}
	return out
}

// Derived returns the headers of a record republished from
// topic/partition/offset: hs without the republishing headers, the origin
// recorded once, and the attempt count replaced. The due time is the
// caller's to add.
func Derived[H Header](hs []H, topic string, partition int32, offset int64, attempts int) []H {
	out := make([]H, 0, len(hs)+6)
	origin := false
	for i := range hs {
		switch raw(hs[i]).Key {
		case HeaderDue, HeaderDeferred, HeaderAttempts, HeaderError:
			continue
		case HeaderOriginTopic:
			origin = true
		}
		out = append(out, hs[i])
	}
	if !origin {
		out = append(out,
			mk[H](HeaderOriginTopic, []byte(topic)),
			mk[H](HeaderOriginPartition, strconv.AppendInt(nil, int64(partition), 10)),
			mk[H](HeaderOriginOffset, strconv.AppendInt(nil, offset, 10)),
		)
	}
	return append(out, mk[H](HeaderAttempts, strconv.AppendInt(nil, int64(attempts), 10)))
}

// RetryHeaders returns Derived's headers plus the due time and, for a
// deferral for lag, HeaderDeferred.
func RetryHeaders[H Header](hs []H, topic string, partition int32, offset int64, attempts int, dueUnixMilli int64, deferred bool) []H {
	out := append(Derived(hs, topic, partition, offset, attempts), mk[H](HeaderDue, strconv.AppendInt(nil, dueUnixMilli, 10)))
	if deferred {
		out = append(out, mk[H](HeaderDeferred, []byte("1")))
	}
	return out
}

// DeadLetterHeaders returns Derived's headers plus the cause, cut to
// MaxErrorHeader bytes.
func DeadLetterHeaders[H Header](hs []H, topic string, partition int32, offset int64, attempts int, cause error) []H {
	text := cause.Error()
	if len(text) > MaxErrorHeader {
		text = text[:MaxErrorHeader]
	}
	return append(Derived(hs, topic, partition, offset, attempts), mk[H](HeaderError, []byte(text)))
}

// TokenValues returns the non-empty values of the token headers in hs.
func TokenValues[H Header](hs []H) []string {
	var vals []string
	for i := range hs {
		if h := raw(hs[i]); h.Key == position.HeaderName && len(h.Value) > 0 {
			vals = append(vals, string(h.Value))
		}
	}
	return vals
}

// TokenOf returns the token hs carry, read with position.DecodeHeaders
// from every position.HeaderName header: the zero Token and nil for none,
// the tokens of several headers merged, and the zero Token with a
// *position.DecodeError when any of them does not decode.
func TokenOf[H Header](hs []H) (position.Token, error) {
	switch first, n := tokenHeader(hs); n {
	case 0:
		return position.Token{}, nil
	case 1:
		return position.DecodeHeaders(string(first))
	}
	return position.DecodeHeaders(TokenValues(hs)...)
}

// DecodeToken is TokenOf through dec, a consumer worker's decoder, for
// headers with one token header (the usual case, decoded without
// allocating; several are merged by TokenOf). The token is valid until
// dec's next call.
func DecodeToken[H Header](dec *position.HeaderDecoder, hs []H) (position.Token, error) {
	switch first, n := tokenHeader(hs); n {
	case 0:
		return position.Token{}, nil
	case 1:
		return dec.Decode(first)
	}
	return TokenOf(hs)
}

// tokenHeader returns the value of the first non-empty token header of
// hs and how many there are.
func tokenHeader[H Header](hs []H) (first []byte, n int) {
	for i := range hs {
		if h := raw(hs[i]); h.Key == position.HeaderName && len(h.Value) > 0 {
			if n == 0 {
				first = h.Value
			}
			n++
		}
	}
	return first, n
}

// Stamped returns hs without its token headers plus one whose value is
// position.MergeHeader of what hs carried and tok, in a new slice. alone,
// when not empty, is tok's header value on its own (what MergeHeader
// returns without an existing header), for stampers that encode one
// token for many records.
func Stamped[H Header](hs []H, tok position.Token, alone string) ([]H, error) {
	existing, err := position.MergeHeaderValues(TokenValues(hs)...)
	if err != nil {
		return nil, fmt.Errorf("the record's token headers merged: %w", err)
	}
	v := alone
	if existing != "" || v == "" {
		if v, err = position.MergeHeader(existing, tok); err != nil {
			return nil, err
		}
	}
	out := make([]H, 0, len(hs)+1)
	for i := range hs {
		if raw(hs[i]).Key != position.HeaderName {
			out = append(out, hs[i])
		}
	}
	return append(out, mk[H](position.HeaderName, []byte(v))), nil
}
