package main

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestParseReplicas: the one reading of --replica that watch, feed and
// doctor share. A string that looks named but is not a NAME=URL is refused
// rather than read as a key=value string whose first key pgconn would take
// for a runtime parameter (and connect to the local socket).
func TestParseReplicas(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		arg, name, dsn string
	}{
		{"r1=postgres://u@db1:5433/app", "r1", "postgres://u@db1:5433/app"},
		{"db-2.example:5432=postgresql://db2/app", "db-2.example:5432", "postgresql://db2/app"},
		{"postgres://u:pw@db1:5433/app?application_name=x", "db1:5433", "postgres://u:pw@db1:5433/app?application_name=x"},
		{"postgres://db1/app?sslmode=disable&application_name=watch", "db1:5432", "postgres://db1/app?sslmode=disable&application_name=watch"},
		{"host=db3 port=5434 dbname=app", "db3:5434", "host=db3 port=5434 dbname=app"},
		{"host=db3 options='-c statement_timeout=5s'", "db3:5432", "host=db3 options='-c statement_timeout=5s'"},
	} {
		got, err := parseReplicas([]string{tc.arg})
		require.NoError(t, err, tc.arg)
		require.Equal(t, []namedDSN{{name: tc.name, dsn: tc.dsn}}, got, tc.arg)
	}
	for _, tc := range []struct{ arg, want string }{
		{"r1=host=db1 port=5432", `--replica "r1"=…: a named replica is NAME=postgres://`},
		{"my replica=postgres://u:secret@db1/app", `--replica "my replica"=…`},
		{"r1= postgres://db1/app", `--replica "r1"=…`},
		{"r1=postgres://db1:notaport/app", "--replica: bad connection string"},
	} {
		_, err := parseReplicas([]string{tc.arg})
		var ue usageError
		require.True(t, errors.As(err, &ue), "%q: %v", tc.arg, err)
		require.Contains(t, ue.msg, tc.want, tc.arg)
		require.NotContains(t, ue.msg, "secret", "the rest of the argument may hold a password")
	}
	_, err := parseReplicas([]string{"postgres://db1/app", "host=db1 port=5432"})
	require.ErrorContains(t, err, `two replicas named "db1:5432"; name them with NAME=URL`)
	got, err := parseReplicas([]string{"a=postgres://db1/app", "b=postgres://db1/app"})
	require.NoError(t, err)
	require.Equal(t, []string{"a", "b"}, []string{got[0].name, got[1].name})
}

// TestReplicaFlagSame: the three commands describe --replica alike.
func TestReplicaFlagSame(t *testing.T) {
	t.Parallel()
	for _, cmd := range []string{"watch", "feed", "doctor"} {
		code, out, errOut := runCLI(t, cmd, "--help")
		require.Equal(t, 0, code, errOut)
		require.Contains(t, out, "--replica [NAME=]URL", cmd)
		require.Contains(t, out, replicaFlagHelp, cmd)
	}
}
