package kafka

import (
	"fmt"
	"strconv"

	"go.opentelemetry.io/otel/propagation"

	"github.com/caughtup/caughtup/position"
)

// Headers the Engine writes on records it republishes to the retry or
// dead-letter topic, besides the token (position.HeaderName), which is
// copied unchanged. Numbers are decimal text. They are both adapters', so
// that a retry topic written by one is read correctly by the other;
// caughtupkafka exports them under its own names too.
const (
	// HeaderDue is when a republished record may run, in Unix
	// milliseconds.
	HeaderDue = "caughtup-due"
	// HeaderDeferred ("1") marks a record republished because no replica
	// had replayed its token, rather than after a handler error: it runs
	// at its due time or as soon as a replica has caught up, whichever
	// comes first.
	HeaderDeferred = "caughtup-deferred"
	// HeaderAttempts counts the handler's failed attempts so far.
	HeaderAttempts = "caughtup-attempts"
	// HeaderOriginTopic, HeaderOriginPartition and HeaderOriginOffset name
	// where the record was first consumed from.
	HeaderOriginTopic     = "caughtup-origin-topic"
	HeaderOriginPartition = "caughtup-origin-partition"
	HeaderOriginOffset    = "caughtup-origin-offset"
	// HeaderError is the last handler error, on dead-lettered records,
	// cut to maxErrorHeader bytes.
	HeaderError = "caughtup-error"
)

// maxErrorHeader bounds the error text written on a dead letter.
const maxErrorHeader = 1024

// Header is a client's header type: kafka.Header and kgo.RecordHeader
// have these fields, so one implementation serves both.
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

// headerHas reports whether hs has a header key.
func headerHas[H Header](hs []H, key string) bool {
	for i := range hs {
		if raw(hs[i]).Key == key {
			return true
		}
	}
	return false
}

// headerGet returns the value of the first header key, or "".
func headerGet[H Header](hs []H, key string) string {
	for i := range hs {
		if h := raw(hs[i]); h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// headerSet returns hs without its headers key, plus one of value, in a new
// slice.
func headerSet[H Header](hs []H, key, value string) []H {
	out := make([]H, 0, len(hs)+1)
	for i := range hs {
		if raw(hs[i]).Key != key {
			out = append(out, hs[i])
		}
	}
	return append(out, mk[H](key, []byte(value)))
}

// headerKeys returns the header names.
func headerKeys[H Header](hs []H) []string {
	keys := make([]string, len(hs))
	for i := range hs {
		keys[i] = raw(hs[i]).Key
	}
	return keys
}

// headerInt returns the last header key as a decimal integer.
func headerInt[H Header](hs []H, key string) (int64, bool) {
	for i := len(hs) - 1; i >= 0; i-- {
		if h := raw(hs[i]); h.Key == key {
			n, err := strconv.ParseInt(string(h.Value), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// MissingHeaders returns fields (a producer's trace context, as
// tracing.Fields gives it) as the headers hs lacks, for stampers.
func MissingHeaders[H Header](hs []H, fields map[string]string) []H {
	var out []H
	for k, v := range fields {
		if !headerHas(hs, k) {
			out = append(out, mk[H](k, []byte(v)))
		}
	}
	return out
}

// derived returns the headers of a record republished from
// topic/partition/offset: hs without the republishing headers, the origin
// recorded once, and the attempt count replaced. The due time is the
// caller's to add.
func derived[H Header](hs []H, topic string, partition int32, offset int64, attempts int) []H {
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

// retryHeaders returns derived's headers plus the due time and, for a
// deferral for lag, HeaderDeferred.
func retryHeaders[H Header](hs []H, topic string, partition int32, offset int64, attempts int, dueUnixMilli int64, deferred bool) []H {
	out := append(derived(hs, topic, partition, offset, attempts), mk[H](HeaderDue, strconv.AppendInt(nil, dueUnixMilli, 10)))
	if deferred {
		out = append(out, mk[H](HeaderDeferred, []byte("1")))
	}
	return out
}

// deadLetterHeaders returns derived's headers plus the cause, cut to
// maxErrorHeader bytes.
func deadLetterHeaders[H Header](hs []H, topic string, partition int32, offset int64, attempts int, cause error) []H {
	text := cause.Error()
	if len(text) > maxErrorHeader {
		text = text[:maxErrorHeader]
	}
	return append(derived(hs, topic, partition, offset, attempts), mk[H](HeaderError, []byte(text)))
}

// tokenValues returns the non-empty values of the token headers in hs.
func tokenValues[H Header](hs []H) []string {
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
	return position.DecodeHeaders(tokenValues(hs)...)
}

// decodeToken is TokenOf through dec, a consumer worker's decoder, for
// headers with one token header (the usual case, decoded without
// allocating; several are merged by TokenOf). The token is valid until
// dec's next call.
func decodeToken[H Header](dec *position.HeaderDecoder, hs []H) (position.Token, error) {
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
	existing, err := position.MergeHeaderValues(tokenValues(hs)...)
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

// HeaderCarrier adapts a record's headers to OpenTelemetry's propagators,
// the way otel contrib's Kafka instrumentations and franz-go's kotel
// plugin carry trace context: Get reads the first header of a key, Set
// replaces every header of the key with one.
type HeaderCarrier[H Header] struct{ Headers *[]H }

var _ propagation.TextMapCarrier = HeaderCarrier[raw]{}

// Get returns the value of the first header named key, or "".
func (c HeaderCarrier[H]) Get(key string) string { return headerGet(*c.Headers, key) }

// Set replaces the headers named key with one of value.
func (c HeaderCarrier[H]) Set(key, value string) { *c.Headers = headerSet(*c.Headers, key, value) }

// Keys returns the header names.
func (c HeaderCarrier[H]) Keys() []string { return headerKeys(*c.Headers) }
