package caughtupkgo_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/position"
)

// Stamping: the token a commit left in the context (enqueue.Commit or
// enqueue.InTx put it there) travels in the caughtup-token header. With a
// *kgo.Client, produce through caughtupkgo.NewProducer instead of calling
// Stamp yourself.
func ExampleStamp() {
	tok := position.New("main", position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1},
		position.MustParseLSN("0/16B3740"), position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
	ctx := enqueue.WithToken(context.Background(), tok) // what enqueue.Commit does after COMMIT

	r := &kgo.Record{Topic: "user-events", Key: []byte("user-42"), Value: []byte(`{"event":"signed_up"}`)}
	if err := caughtupkgo.Stamp(ctx, r); err != nil {
		panic(err)
	}
	for _, h := range r.Headers {
		fmt.Printf("%s: %s\n", h.Key, h.Value)
	}

	// The consumer side reads it back (the Consumer does this for you).
	got, err := caughtupkgo.TokenOf(r)
	fmt.Println(got.String() == tok.String(), err)
	// Output:
	// caughtup-token: v1;loyw3v28;main=p.6f1e2d3c4b5a6978.1.0/16B3740
	// true <nil>
}

// A record whose token header does not decode (written by a newer
// producer, or damaged) is no token at all: TokenOf returns the decode
// error, and the router, given both, reads the primary. Stamp keeps such
// a header as it is rather than replace it with the context's token:
// unknown stays unknown.
func ExampleTokenOf() {
	r := &kgo.Record{Headers: []kgo.RecordHeader{{Key: position.HeaderName, Value: []byte("v9;from-the-future")}}}
	tok := position.New("main", position.Epoch{SystemID: 1, Timeline: 1}, 100, position.SourcePrimary, time.UnixMilli(0))
	if err := caughtupkgo.Stamp(enqueue.WithToken(context.Background(), tok), r); err != nil {
		panic(err)
	}
	got, err := caughtupkgo.TokenOf(r)
	fmt.Println(len(r.Headers), string(r.Headers[0].Value), got.IsZero(), errors.Is(err, position.ErrUnknownVersion))
	// Output:
	// 1 v9;from-the-future true true
}
