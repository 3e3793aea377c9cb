package proxytest_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/proxytest"
)

// fault.Proxy in front of real standbys: a moved target takes the new
// connections only; refused connections fail at once and blackholed ones
// by the client's own timeout.
func TestFaultProxyBetweenStandbys(t *testing.T) {
	t.Parallel()
	r, db, ctx := setup(t)
	addrs := proxytest.Addrs(r...)
	p, err := fault.NewProxy(addrs[0])
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	dsn := dsnAt(p.Addr(), db)

	old := connect(ctx, t, dsn)
	require.Equal(t, r[0].Port(), serverPort(ctx, t, old))
	p.SetTarget(addrs[1])
	require.Equal(t, r[1].Port(), serverPort(ctx, t, connect(ctx, t, dsn)), "a new connection reaches the new target")
	require.Equal(t, r[0].Port(), serverPort(ctx, t, old), "an established one keeps its standby")

	p.Refuse()
	began := time.Now()
	_, err = pgx.Connect(ctx, dsn)
	require.Error(t, err)
	require.Less(t, time.Since(began), 2*time.Second, "refused at once: %v", err)
	require.Equal(t, r[0].Port(), serverPort(ctx, t, old), "refusing leaves established connections alone")

	p.Blackhole()
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = pgx.Connect(cctx, dsn)
	require.Error(t, err)
	require.True(t, errors.Is(err, context.DeadlineExceeded), "a blackholed connection hangs until the client gives up: %v", err)
	require.Equal(t, r[0].Port(), serverPort(ctx, t, old))

	p.Accept()
	require.Equal(t, r[1].Port(), serverPort(ctx, t, connect(ctx, t, dsn)), "accepted again")

	// Cut ends every connection through the proxy: the three this test
	// opened, and perhaps the blackholed one that Accept released after
	// its client had given up.
	require.GreaterOrEqual(t, p.Cut(), 3)
	var one int
	require.Error(t, old.QueryRow(ctx, "SELECT 1").Scan(&one), "a cut connection is gone")
}
