package kafka

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/caughtup/caughtup/position"
)

var epoch = position.Epoch{SystemID: 7, Timeline: 1}

func tok(lsn position.LSN) position.Token {
	return position.New("main", epoch, lsn, position.SourcePrimary, time.Unix(1700000000, 0))
}

// The helpers work on both clients' header types alike.
func TestBothClients(t *testing.T) {
	t.Parallel()
	kh := retryHeaders([]kafkago.Header{{Key: "x", Value: []byte("1")}}, "t", 3, 42, 2, 1000, true)
	gh := retryHeaders([]kgo.RecordHeader{{Key: "x", Value: []byte("1")}}, "t", 3, 42, 2, 1000, true)
	require.Equal(t, headerKeys(kh), headerKeys(gh))
	for _, k := range headerKeys(kh) {
		require.Equal(t, headerGet(kh, k), headerGet(gh, k))
	}
}

// Derived records the origin once, replaces the attempt count and drops
// the republishing headers of an earlier round; RetryHeaders and
// DeadLetterHeaders add theirs.
func TestDerived(t *testing.T) {
	t.Parallel()
	first := retryHeaders([]kafkago.Header{{Key: position.HeaderName, Value: []byte("tok")}}, "orders", 1, 10, 1, 5000, true)
	require.Equal(t, "orders", headerGet(first, HeaderOriginTopic))
	require.Equal(t, "1", headerGet(first, HeaderOriginPartition))
	require.Equal(t, "10", headerGet(first, HeaderOriginOffset))
	require.Equal(t, "1", headerGet(first, HeaderAttempts))
	require.Equal(t, "5000", headerGet(first, HeaderDue))
	require.Equal(t, "1", headerGet(first, HeaderDeferred))
	require.Equal(t, "tok", headerGet(first, position.HeaderName), "the token is copied unchanged")

	again := retryHeaders(first, "orders.retry", 0, 99, 2, 9000, false)
	require.Equal(t, "orders", headerGet(again, HeaderOriginTopic), "the origin is the first topic's")
	require.Equal(t, "10", headerGet(again, HeaderOriginOffset))
	n, ok := headerInt(again, HeaderAttempts)
	require.True(t, ok)
	require.Equal(t, int64(2), n)
	require.False(t, headerHas(again, HeaderDeferred), "a handler retry is not a deferral")
	due, _ := headerInt(again, HeaderDue)
	require.Equal(t, int64(9000), due)
	require.Len(t, again, len(first)-1, "no header twice")

	dead := deadLetterHeaders(again, "orders.retry", 0, 100, 5, errors.New(strings.Repeat("e", 2*maxErrorHeader)))
	require.Len(t, headerGet(dead, HeaderError), maxErrorHeader)
	require.False(t, headerHas(dead, HeaderDue))
}

// Stamped merges the token headers into one; TokenOf reads them back, and
// one that does not decode makes the token unreadable.
func TestStampedAndTokenOf(t *testing.T) {
	t.Parallel()
	a, _ := tok(100).Encode()
	hs := []kgo.RecordHeader{{Key: position.HeaderName, Value: []byte(a)}, {Key: "other", Value: []byte("v")}}
	out, err := Stamped(hs, tok(200), "")
	require.NoError(t, err)
	require.Equal(t, []string{"other", position.HeaderName}, headerKeys(out))
	got, err := TokenOf(out)
	require.NoError(t, err)
	require.Equal(t, position.LSN(200), got.Entries[0].LSN)
	require.Equal(t, a, string(hs[0].Value), "the input is not modified")

	none, err := TokenOf([]kafkago.Header{{Key: "x"}})
	require.NoError(t, err)
	require.True(t, none.IsZero())
	_, err = TokenOf([]kafkago.Header{{Key: position.HeaderName, Value: []byte(a)}, {Key: position.HeaderName, Value: []byte("garbage")}})
	var de *position.DecodeError
	require.ErrorAs(t, err, &de)
	_, err = Stamped([]kafkago.Header{{Key: position.HeaderName, Value: []byte("garbage")}, {Key: position.HeaderName, Value: []byte(a)}}, tok(1), "")
	require.NoError(t, err, "a header that does not decode stays, as position.MergeHeader keeps it")
}

// DecodeToken, through a consumer's decoder, answers as TokenOf does for
// no, one, several and malformed token headers.
func TestDecodeTokenIsTokenOf(t *testing.T) {
	t.Parallel()
	a, _ := tok(100).Encode()
	b, _ := tok(300).Encode()
	var dec position.HeaderDecoder
	for name, hs := range map[string][]kafkago.Header{
		"none":      {{Key: "x", Value: []byte("v")}},
		"empty":     {{Key: position.HeaderName}},
		"one":       {{Key: "x"}, {Key: position.HeaderName, Value: []byte(a)}},
		"several":   {{Key: position.HeaderName, Value: []byte(a)}, {Key: position.HeaderName, Value: []byte(b)}},
		"malformed": {{Key: position.HeaderName, Value: []byte("garbage")}},
	} {
		want, wantErr := TokenOf(hs)
		for range 2 { // the second time from the decoder's memory
			got, err := decodeToken(&dec, hs)
			require.Equal(t, wantErr == nil, err == nil, name)
			require.Equal(t, want.String(), got.String(), name)
		}
	}
}

// Set replaces every header of a key with one; Missing adds only absent
// fields.
func TestSetAndMissing(t *testing.T) {
	t.Parallel()
	hs := headerSet([]kafkago.Header{{Key: "k", Value: []byte("1")}, {Key: "k", Value: []byte("2")}}, "k", "3")
	require.Equal(t, []kafkago.Header{{Key: "k", Value: []byte("3")}}, hs)
	add := MissingHeaders(hs, map[string]string{"k": "x", "traceparent": "00-…"})
	require.Equal(t, []kafkago.Header{{Key: "traceparent", Value: []byte("00-…")}}, add)
}

// HeaderCarrier: Set replaces every header of a key with one, Get reads
// the first, and the trace context round-trips through the headers, on
// both clients' header types.
func TestHeaderCarrier(t *testing.T) {
	t.Parallel()
	t.Run("kafka-go", func(t *testing.T) { testHeaderCarrier[kafkago.Header](t) })
	t.Run("franz-go", func(t *testing.T) { testHeaderCarrier[kgo.RecordHeader](t) })
}

func testHeaderCarrier[H Header](t *testing.T) {
	h := func(k, v string) H { return mk[H](k, []byte(v)) }
	hs := []H{h("traceparent", "old"), h("x", "1"), h("traceparent", "older")}
	c := HeaderCarrier[H]{Headers: &hs}
	require.Equal(t, "old", c.Get("traceparent"))
	c.Set("traceparent", "new")
	require.Equal(t, []H{h("x", "1"), h("traceparent", "new")}, hs)
	require.ElementsMatch(t, []string{"x", "traceparent"}, c.Keys())
	require.Empty(t, c.Get("missing"))

	tp := sdktrace.NewTracerProvider()
	ctx, span := tp.Tracer("test").Start(context.Background(), "produce")
	defer span.End()
	var rec []H
	propagation.TraceContext{}.Inject(ctx, HeaderCarrier[H]{Headers: &rec})
	got := propagation.TraceContext{}.Extract(context.Background(), HeaderCarrier[H]{Headers: &rec})
	require.Equal(t, span.SpanContext().TraceID(), trace.SpanContextFromContext(got).TraceID())
}
