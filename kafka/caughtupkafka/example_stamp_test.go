package caughtupkafka_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
)

// Stamping: the token a commit left in the context (enqueue.Commit or
// enqueue.InTx put it there) travels in the caughtup-token header. With a
// *kafka.Writer, wrap it in caughtupkafka.NewWriter instead of calling
// Stamp yourself.
func ExampleStamp() {
	tok := position.New("main", position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1},
		position.MustParseLSN("0/16B3740"), position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
	ctx := enqueue.WithToken(context.Background(), tok) // what enqueue.Commit does after COMMIT

	msg := kafka.Message{Key: []byte("user-42"), Value: []byte(`{"event":"signed_up"}`)}
	if err := caughtupkafka.Stamp(ctx, &msg); err != nil {
		panic(err)
	}
	for _, h := range msg.Headers {
		fmt.Printf("%s: %s\n", h.Key, h.Value)
	}

	// The consumer side reads it back (the Consumer does this for you).
	got, err := caughtupkafka.TokenOf(msg)
	fmt.Println(got.String() == tok.String(), err)
	// Output:
	// caughtup-token: v1;loyw3v28;main=p.6f1e2d3c4b5a6978.1.0/16B3740
	// true <nil>
}

// A message whose token header does not decode (written by a newer
// producer, or damaged) is no token at all: TokenOf returns the decode
// error, and the router, given both, reads the primary.
func ExampleTokenOf() {
	msg := kafka.Message{Headers: []kafka.Header{{Key: position.HeaderName, Value: []byte("v9;from-the-future")}}}
	tok, err := caughtupkafka.TokenOf(msg)
	fmt.Println(tok.IsZero(), errors.Is(err, position.ErrUnknownVersion))
	// ctx, _, err := router.Route(ctx, consume.Job{Token: tok, TokenErr: err, Policy: consume.Delayed}) → the primary
	// Output:
	// true true
}
