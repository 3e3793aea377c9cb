package consume

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/replay"
)

// TestMissingGrant: a tracker role without pg_read_all_stats cannot see a
// standby's timeline, so no replica can be used. That is its own reason,
// in decisions and in the Snapshot, with the GRANT to run, logged once;
// once granted, the replicas serve jobs.
func TestMissingGrant(t *testing.T) {
	t.Parallel()
	c := privateCluster(t)
	e := setup(t, c)
	ctx := ctxT(t)
	role := fmt.Sprintf("tracker_%d", time.Now().UnixNano()%1e9)
	_, err := e.primary.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN", role))
	require.NoError(t, err)
	_, err = e.primary.Exec(ctx, fmt.Sprintf("GRANT SELECT ON items TO %s", role))
	require.NoError(t, err)
	require.NoError(t, c.WaitReplicasCaughtUp(ctx))
	as := func(port int) *pgxpool.Pool {
		p, err := pgxpool.New(ctx, fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", role, port, e.db))
		require.NoError(t, err)
		t.Cleanup(p.Close)
		return p
	}
	var reps []replay.Replica
	for i, n := range c.Replicas() {
		reps = append(reps, replay.Replica{Name: fmt.Sprintf("r%d", i+1), Pool: as(n.Port())})
	}
	logs := &captured{}
	r := e.router(t, func(cfg *Config) {
		cfg.Databases = map[string]replay.Database{"main": {Primary: as(c.Primary().Port()), Replicas: reps}}
		cfg.Logger = slog.New(logs)
		cfg.WaitBudget = -1
	})
	_, tok := e.write(t)
	s := waitUntil(t, r, "the replicas are unknown for the grant", func(s *replay.Snapshot) bool {
		for _, rs := range s.Database("main").Replicas {
			if !errors.Is(rs.Err, replay.ErrMissingGrant) {
				return false
			}
		}
		return true
	})
	var ge *replay.GrantError
	require.ErrorAs(t, s.Database("main").Replicas[0].Err, &ge)
	require.Equal(t, fmt.Sprintf(`GRANT pg_read_all_stats TO "%s";`, role), strings.TrimSpace(ge.Grant))
	_, d, err := r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, ReasonMissingGrant, d.Reason)
	require.Equal(t, OutcomePrimary, d.Outcome)
	time.Sleep(300 * time.Millisecond) // more polls, no more warnings
	warned := logs.lines("caughtup: the tracker's role lacks a privilege")
	require.Len(t, warned, len(reps), "one warning per replica: %v", warned)

	_, err = e.primary.Exec(ctx, ge.Grant)
	require.NoError(t, err)
	seen(t, r, tok)
	_, d, err = r.Route(ctx, Job{Token: tok, Policy: Sticky})
	require.NoError(t, err)
	require.Equal(t, OutcomeReplica, d.Outcome, "granted, the replicas serve jobs")
}
