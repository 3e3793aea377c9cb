package caughtupkgo_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

func testToken(db string, lsn position.LSN) position.Token {
	return position.New(db, position.Epoch{SystemID: 7, Timeline: 1}, lsn, position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
}

// Stamp merges with the token headers a record already has, into one.
func TestStampMerges(t *testing.T) {
	t.Parallel()
	prev := testToken("main", 200)
	prevHeader, err := prev.Encode()
	require.NoError(t, err)
	shared := []kgo.RecordHeader{{Key: "a", Value: []byte("1")}, {Key: position.HeaderName, Value: []byte(prevHeader)}}
	r := &kgo.Record{Headers: shared}
	ctx := enqueue.WithToken(context.Background(), testToken("main", 100).Merge(testToken("other", 50)))
	require.NoError(t, caughtupkgo.Stamp(ctx, r))
	require.Equal(t, position.HeaderName, shared[1].Key, "the caller's header slice was modified")
	require.Equal(t, prevHeader, string(shared[1].Value), "the caller's header slice was modified")
	n := 0
	for _, h := range r.Headers {
		if h.Key == position.HeaderName {
			n++
		}
	}
	require.Equal(t, 1, n, "headers %v", r.Headers)
	got, err := caughtupkgo.TokenOf(r)
	require.NoError(t, err)
	main, ok := got.Entry("main")
	require.True(t, ok)
	require.Equal(t, position.LSN(200), main.LSN, "the larger position of main")
	_, ok = got.Entry("other")
	require.True(t, ok)
}

// Without a token in the context a record is unchanged; TokenOf of a
// record without one is the zero token and no error.
func TestStampWithoutToken(t *testing.T) {
	t.Parallel()
	r := &kgo.Record{Headers: []kgo.RecordHeader{{Key: "a", Value: []byte("1")}}}
	require.NoError(t, caughtupkgo.Stamp(context.Background(), r))
	require.Len(t, r.Headers, 1)
	tok, err := caughtupkgo.TokenOf(r)
	require.NoError(t, err)
	require.True(t, tok.IsZero())
}

// A token that cannot be carried (too many databases) is an error and
// leaves the record alone; the Producer then produces nothing.
func TestStampRefusesUncarriable(t *testing.T) {
	t.Parallel()
	var tok position.Token
	for i := range position.MaxDatabases + 1 {
		tok = tok.Merge(testToken(fmt.Sprintf("db%d", i), 1))
	}
	r := &kgo.Record{}
	require.Error(t, caughtupkgo.Stamp(enqueue.WithToken(context.Background(), tok), r))
	require.Empty(t, r.Headers)

	p := caughtupkgo.NewProducer(newClient(t))
	res := p.ProduceSync(enqueue.WithToken(context.Background(), tok), &kgo.Record{Topic: "never-created"}, &kgo.Record{Topic: "never-created"})
	require.Len(t, res, 2)
	for _, pr := range res {
		require.Error(t, pr.Err)
	}
	var promised error
	p.Produce(enqueue.WithToken(context.Background(), tok), &kgo.Record{Topic: "never-created"}, func(_ *kgo.Record, err error) { promised = err })
	require.Error(t, promised)
}

// The Producer stamps what goes on the wire: the consumer side
// sees the token the producer's commit captured.
func TestProducerStampsOnTheWire(t *testing.T) {
	e := setupDB(t, nil)
	topic := kafkasuite.NewTopics(t, 1, "")[0]
	p := caughtupkgo.NewProducer(newClient(t, kgo.DefaultProduceTopic(topic)))
	ctx, err := e.Insert(t.Context(), 1, "k", 0)
	require.NoError(t, err)
	want, _ := enqueue.TokenFrom(ctx)
	require.NoError(t, p.ProduceSync(ctx, &kgo.Record{Value: []byte("v")}).FirstErr())

	cl := newClient(t, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	fctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	var got []*kgo.Record
	for len(got) == 0 && fctx.Err() == nil {
		got = append(got, cl.PollFetches(fctx).Records()...)
	}
	require.Len(t, got, 1)
	tok, err := caughtupkgo.TokenOf(got[0])
	require.NoError(t, err)
	require.Equal(t, want.String(), tok.String())
}
