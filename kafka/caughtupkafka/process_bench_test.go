package caughtupkafka

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/pgtest"
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
	c := pgtest.Shared(b)
	db := pgtest.NewDatabase(b, c)
	ctx := context.Background()
	primary, err := c.Primary().Pool(ctx, db)
	require.NoError(b, err)
	b.Cleanup(primary.Close)
	var replicas []replay.Replica
	for _, n := range c.Replicas() {
		p, err := n.Pool(ctx, db)
		require.NoError(b, err)
		b.Cleanup(p.Close)
		replicas = append(replicas, replay.Replica{Name: n.Name(), Pool: p})
	}
	router, err := consume.NewRouter(ctx, consume.Config{Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replicas}}})
	require.NoError(b, err)
	b.Cleanup(func() { _ = router.Close() })
	require.NoError(b, c.WaitReplicasCaughtUp(ctx))
	snap := router.Snapshot().Database("main")
	low := snap.Replicas[0].Replayed.LSN
	for _, r := range snap.Replicas[1:] {
		low = min(low, r.Replayed.LSN)
	}
	msgs := make([]kafka.Message, 4096)
	for i := range msgs {
		tok := position.New("main", snap.Primary.Epoch, low-position.LSN(i), position.SourcePrimary, time.Now())
		msgs[i] = kafka.Message{Topic: "t", Value: []byte("x")}
		require.NoError(b, Stamp(enqueue.WithToken(ctx, tok), &msgs[i]))
	}
	cons, err := NewConsumer(ConsumerConfig{Brokers: []string{"localhost:1"}, GroupID: "g", Topic: "t", Router: router},
		func(ctx context.Context, msg kafka.Message) error {
			_, err := consume.Pool(ctx, "main")
			return err
		})
	require.NoError(b, err)
	for name, msgs := range map[string][]kafka.Message{
		"token-per-message": msgs,
		"one-token":         msgs[:1], // a batch stamped with one position: decoded once
		"no-token":          {{Topic: "t", Value: []byte("x")}},
	} {
		b.Run(name, func(b *testing.B) {
			src := &sliceSource{msgs: msgs, n: b.N}
			p := cons.eng.NewPartition("t", 0, src)
			b.ReportAllocs()
			b.ResetTimer()
			cpu0 := kafkasuite.ProcessCPUTime()
			p.Run(ctx)
			b.StopTimer()
			if src.n > 0 || p.Topic() != "t" {
				b.Fatal("not every message was processed")
			}
			b.ReportMetric(float64((kafkasuite.ProcessCPUTime()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
			p.Flush(ctx)
		})
	}
}

// sliceSource hands out n messages of msgs in turn, then none.
type sliceSource struct {
	msgs []kafka.Message
	i, n int
}

func (s *sliceSource) Next(context.Context) (*kafka.Message, bool) {
	if s.n == 0 {
		return nil, false
	}
	s.n--
	m := &s.msgs[s.i%len(s.msgs)]
	s.i++
	return m, true
}

func (*sliceSource) Pause()  {}
func (*sliceSource) Resume() {}
