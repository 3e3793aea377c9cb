package caughtupkafka

import (
	"context"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// BenchmarkProcess is what the Consumer spends on one message besides
// fetching it (a partition's worker over a source that hands out messages
// already in memory): reading its token, routing it through the partition's
// Tally, calling a handler that only asks for its pool (as
// BenchmarkThroughput's trivial handler does), counting the result. Each
// message carries a token of its own (as each producer's commit gives),
// caught up on every replica. Besides ns/op it reports cpu-ns/op, the
// process's CPU time per message (garbage collection included), which
// other work on a shared machine inflates far less than wall-clock time.
func BenchmarkProcess(b *testing.B) {
	ctx := context.Background()
	router, tokens := kafkasuite.ProcessRouter(b)
	msgs := make([]*kafka.Message, 4096)
	for i, tok := range tokens(len(msgs), 1) {
		msgs[i] = &kafka.Message{Topic: "t", Value: []byte("x")}
		require.NoError(b, Stamp(enqueue.WithToken(ctx, tok), msgs[i]))
	}
	cons, err := NewConsumer(ConsumerConfig{Brokers: []string{"localhost:1"}, GroupID: "g", Topic: "t", Router: router},
		func(ctx context.Context, msg kafka.Message) error {
			_, err := consume.Pool(ctx, "main")
			return err
		})
	require.NoError(b, err)
	for name, msgs := range map[string][]*kafka.Message{
		"token-per-message": msgs,
		"one-token":         msgs[:1], // a batch stamped with one position: decoded once
		"no-token":          {{Topic: "t", Value: []byte("x")}},
	} {
		b.Run(name, func(b *testing.B) {
			src := &kafkasuite.SliceSource[*kafka.Message]{Records: msgs, N: b.N}
			kafkasuite.RunPartition(b, cons.eng.NewPartition("t", 0, src), src)
		})
	}
}
