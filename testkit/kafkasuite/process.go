package kafkasuite

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// ProcessRouter is what both adapters' BenchmarkProcess route through: a
// Router on a database of the shared cluster, its replicas caught up, and
// tokens makes n tokens for database "main" that every replica has
// already replayed, distinct but for runs of run tokens that are the same
// (run 1: a token each), as records carrying them would.
func ProcessRouter(b *testing.B) (router *consume.Router, tokens func(n, run int) []position.Token) {
	b.Helper()
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
	router, err = consume.NewRouter(ctx, consume.Config{Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replicas}}})
	require.NoError(b, err)
	b.Cleanup(func() { _ = router.Close() })
	require.NoError(b, c.WaitReplicasCaughtUp(ctx))
	snap := router.Snapshot().Database("main")
	low := snap.Replicas[0].Replayed.LSN
	for _, r := range snap.Replicas[1:] {
		low = min(low, r.Replayed.LSN)
	}
	return router, func(n, run int) []position.Token {
		toks := make([]position.Token, n)
		for i := range toks {
			toks[i] = position.New("main", snap.Primary.Epoch, low-position.LSN(i/run), position.SourcePrimary, time.Now())
		}
		return toks
	}
}

// RunPartition runs p over src until src has handed out its records, as
// a sub-benchmark of BenchmarkProcess, and reports cpu-ns/op besides
// ns/op: the process's CPU time per record (garbage collection
// included), which other work on a shared machine inflates far less than
// wall-clock time.
func RunPartition[R any, H kafka.Header](b *testing.B, p *kafka.Partition[R, H], src *SliceSource[R]) {
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := ProcessCPUTime()
	p.Run(ctx)
	b.StopTimer()
	if src.N > 0 {
		b.Fatal("not every record was processed")
	}
	b.ReportMetric(float64((ProcessCPUTime()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	p.Flush(ctx)
}

// SliceSource is a partition's kafka.Source over records already in
// memory: it hands out N of Records in turn, then none.
type SliceSource[R any] struct {
	Records []R
	N       int
	i       int
}

var _ kafka.Source[*struct{}] = (*SliceSource[*struct{}])(nil)

func (s *SliceSource[R]) Next(context.Context) (R, bool) {
	if s.N == 0 {
		var none R
		return none, false
	}
	s.N--
	r := s.Records[s.i%len(s.Records)]
	s.i++
	return r, true
}

func (*SliceSource[R]) Pause()  {}
func (*SliceSource[R]) Resume() {}
