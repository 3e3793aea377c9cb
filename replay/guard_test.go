package replay

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/internal/pgwal"
)

// The guard's rule as a pure function.
func TestGuardAdmit(t *testing.T) {
	t.Parallel()
	i1, i2 := inc(0, 1), inc(5000, 5001)
	st := ReplicaState{Observations: 3, Incarnation: i1, HighestReplayed: lsn("0/3000000")}
	conn := func(i Incarnation, at string) pgwal.Replica {
		return pgwal.Replica{InRecovery: true, LSN: lsn(at), PostmasterStart: i.PostmasterStart, RecoveryStart: i.RecoveryStart}
	}
	require.True(t, admit(conn(i1, "0/3000000"), &st), "at the highest replay")
	require.False(t, admit(conn(i1, "0/2FFFFFF"), &st), "below it")
	require.False(t, admit(conn(i2, "0/3800000"), &st), "a run the tracker has not seen yet")
	st2 := st
	st2.Incarnation = i2
	require.True(t, admit(conn(i1, "0/3000000"), &st2), "the tracker has seen a newer run (this connection is about to die)")
	require.False(t, admit(conn(i1, "0/3000000"), &ReplicaState{}), "the tracker has not observed the replica")
	require.True(t, admit(pgwal.Replica{InRecovery: false}, &st), "out of recovery it has everything it replayed")
}

func TestGuardConfig(t *testing.T) {
	t.Parallel()
	_, err := NewGuard(GuardConfig{HoldTimeout: -1})
	require.ErrorIs(t, err, ErrInvalidConfig)
	g, err := NewGuard(GuardConfig{})
	require.NoError(t, err)
	require.Equal(t, DefaultGuardHoldTimeout, g.cfg.HoldTimeout)

	primary := &pgxpool.Pool{}
	dbs := map[string]Database{"main": {Primary: primary,
		Replicas: []Replica{{Name: "r1", Pool: &pgxpool.Pool{}, Guard: g}}}}
	require.ErrorContains(t, ValidateDatabases(dbs), "not installed")
	g.Install(&pgxpool.Config{})
	require.NoError(t, ValidateDatabases(dbs))
	dbs["main"] = Database{Primary: primary, Replicas: []Replica{
		{Name: "r1", Pool: &pgxpool.Pool{}, Guard: g}, {Name: "r2", Pool: &pgxpool.Pool{}, Guard: g}}}
	require.ErrorContains(t, ValidateDatabases(dbs), "one Guard serves one replica pool")
}
