package kafka_test

import (
	"context"
	"fmt"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/enqueue"
	caughtupkafka "github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
)

// Stamping: the token a commit left in the context (enqueue.Commit or
// enqueue.InTx put it there) travels in the caughtup-token header. With a
// *kafkago.Writer, wrap it in caughtupkafka.NewWriter instead of calling
// Stamp yourself.
func ExampleStamp() {
	tok := position.New("main", position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1},
		position.MustParseLSN("0/16B3740"), position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
	ctx := enqueue.WithToken(context.Background(), tok) // what enqueue.Commit does after COMMIT

	msg := kafkago.Message{Key: []byte("user-42"), Value: []byte(`{"event":"signed_up"}`)}
	if err := caughtupkafka.Stamp(ctx, &msg); err != nil {
		panic(err)
	}
	for _, h := range msg.Headers {
		fmt.Printf("%s: %s\n", h.Key, h.Value)
	}
	fmt.Println(caughtupkafka.TokenHeader(msg) == string(msg.Headers[0].Value))
	// Output:
	// caughtup-token: v1;loyw3v28;main=p.6f1e2d3c4b5a6978.1.0/16B3740
	// true
}
