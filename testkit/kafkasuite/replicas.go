package kafkasuite

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
)

// BareReplicas is what a throughput benchmark's bare side reads: the
// replicas the routed side's router routes to, with their names, through
// pools of their own built from the test's pools' configs, as the router
// builds its handlers' pools (the test's pools also serve the router's
// tracker).
type BareReplicas struct {
	pools []*pgxpool.Pool
	names []string
	turn  atomic.Uint32
}

// NewBareReplicas builds the bare side's pools for router's replicas of
// database "main", each from the config of e's pool it is.
func NewBareReplicas(t testing.TB, e *Env, router *consume.Router) *BareReplicas {
	rs := &BareReplicas{}
	for _, rep := range router.Config().Databases["main"].Replicas {
		i := slices.IndexFunc(e.Replicas, func(p *pgxpool.Pool) bool { return p == rep.Pool })
		require.GreaterOrEqual(t, i, 0, "a replica of the router that is not one of the test's pools")
		p, err := pgxpool.NewWithConfig(context.Background(), e.Replicas[i].Config())
		require.NoError(t, err)
		t.Cleanup(p.Close)
		rs.pools, rs.names = append(rs.pools, p), append(rs.names, rep.Name)
	}
	return rs
}

// At is replica i mod their number.
func (rs *BareReplicas) At(i int) (*pgxpool.Pool, string) {
	i %= len(rs.pools)
	return rs.pools[i], rs.names[i]
}

// Next is the next replica in turn: one counter for every reader, each
// query on another replica than the last one's.
func (rs *BareReplicas) Next() (*pgxpool.Pool, string) { return rs.At(int(rs.turn.Add(1))) }
