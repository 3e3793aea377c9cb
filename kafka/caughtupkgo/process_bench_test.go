package caughtupkgo

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// BenchmarkProcess is what the Consumer's worker spends on one record
// besides fetching it and handing it to the partition (a worker over a
// source that hands out records already in memory): reading its token,
// routing it through the partition's Tally, calling a handler that only
// asks for its pool (as BenchmarkThroughput's trivial handler does),
// counting the result. Sub-benchmarks:
//
//   - plain: the loop alone, Source.Next and the handler on a context
//     routed once: the floor the others are priced against;
//   - token-per-record: each record carries a token of its own (as each
//     producer's commit gives), caught up on every replica;
//   - runs-of-16: runs of 16 records with the same token header (one
//     transaction's events, an outbox relay's batch), the runs' tokens
//     distinct;
//   - one-token: every record carries the same token;
//   - no-token: records without a token header (read on the primary).
//
// Besides ns/op it reports cpu-ns/op, the process's CPU time per record
// (garbage collection included), which other work on a shared machine
// inflates far less than wall-clock time.
func BenchmarkProcess(b *testing.B) {
	ctx := context.Background()
	router, tokens := kafkasuite.ProcessRouter(b)
	stamped := func(n, run int) []*kgo.Record {
		rs := make([]*kgo.Record, n)
		for i, tok := range tokens(n, run) {
			rs[i] = &kgo.Record{Topic: "t", Value: []byte("x")}
			require.NoError(b, Stamp(enqueue.WithToken(ctx, tok), rs[i]))
		}
		return rs
	}
	handler := func(ctx context.Context, r *kgo.Record) error {
		_, err := consume.Pool(ctx, "main")
		return err
	}
	cons, err := NewConsumer(ConsumerConfig{ClientOpts: []kgo.Opt{kgo.SeedBrokers("localhost:1")}, GroupID: "g", Topic: "t", Router: router}, handler)
	require.NoError(b, err)

	b.Run("plain", func(b *testing.B) {
		hctx, _, err := router.Route(ctx, consume.Job{Policy: consume.Delayed})
		require.NoError(b, err)
		src := &kafkasuite.SliceSource[*kgo.Record]{Records: stamped(4096, 1), N: b.N}
		b.ReportAllocs()
		cpu0 := kafkasuite.ProcessCPUTime()
		for {
			r, ok := src.Next(ctx)
			if !ok {
				break
			}
			if err := handler(hctx, r); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64((kafkasuite.ProcessCPUTime()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	})
	for _, bc := range []struct {
		name string
		recs []*kgo.Record
	}{
		{"token-per-record", stamped(4096, 1)},
		{"runs-of-16", stamped(4096, 16)},
		{"one-token", stamped(1, 1)},
		{"no-token", []*kgo.Record{{Topic: "t", Value: []byte("x")}}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			src := &kafkasuite.SliceSource[*kgo.Record]{Records: bc.recs, N: b.N}
			kafkasuite.RunPartition(b, cons.eng.NewPartition("t", 0, src), src)
		})
	}
}
