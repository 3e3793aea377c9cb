package pgwal

import (
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPrivilegesCoverTheQueries: every pg_* and inet_* function and
// every view the queries of this package call is in Privileges, and
// Privileges names nothing they do not call, so that a new query cannot
// leave caughtup doctor checking the wrong grants.
func TestPrivilegesCoverTheQueries(t *testing.T) {
	t.Parallel()
	queries := []string{primaryQueryControl, replicaQueries[Control|Status], historyQuery, identityQuery, systemIDQuery, clockQuery}
	all := strings.Join(queries, "\n")
	called := map[string]bool{}
	for _, m := range regexp.MustCompile(`\b((?:pg|inet)_[a-z_]+)\s*\(`).FindAllStringSubmatch(all, -1) {
		called[m[1]] = true
	}
	views := map[string]bool{}
	for _, m := range regexp.MustCompile(`\bFROM\s+(pg_[a-z_]+)\b(?:\s*\()?`).FindAllStringSubmatch(all, -1) {
		if !strings.HasSuffix(m[0], "(") {
			views[m[1]] = true
		}
	}
	require.NotEmpty(t, called)
	require.Equal(t, map[string]bool{"pg_stat_wal_receiver": true}, views)

	listed, listedViews := map[string]bool{}, map[string]bool{}
	for _, p := range Privileges {
		switch {
		case p.Function != "":
			name, _, _ := strings.Cut(p.Function, "(")
			listed[name] = true
		case p.View != "":
			listedViews[p.View] = true
		}
		require.NotZero(t, p.Need, p.Name())
		require.NotEmpty(t, p.Lost, p.Name())
	}
	// The view runs this function as the caller, who needs EXECUTE on it.
	called["pg_stat_get_wal_receiver"] = true
	for name := range called {
		require.True(t, listed[name], "Privileges lacks %s(), which a query calls", name)
	}
	for name := range listed {
		require.True(t, called[name], "Privileges lists %s(), which no query calls", name)
	}
	require.Equal(t, views, listedViews)
	require.True(t, slices.ContainsFunc(Privileges, func(p Privilege) bool { return p.Role == "pg_read_all_stats" }))
}
