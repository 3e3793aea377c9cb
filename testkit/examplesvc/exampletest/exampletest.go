// Package exampletest runs an example program (an examplesvc.RunFunc) from
// its test, the way each examples/*/main_test.go does.
package exampletest

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/examplesvc"
)

// Run runs the program with args on its own services (or on those the
// environment names) and returns what it printed. It fails the test, with
// stderr, if the program fails, and logs stderr otherwise: where the
// messages ran varies from run to run and is worth seeing.
func Run(t testing.TB, run examplesvc.RunFunc, args ...string) (stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(t.Context(), args, &out, &errOut)
	require.NoError(t, err, "stderr:\n%s", errOut.String())
	t.Logf("stdout: %sstderr:\n%s", out.String(), errOut.String())
	return out.String(), errOut.String()
}

// BadFlags checks that the program refuses each set of arguments before it
// starts anything, printing nothing on stdout.
func BadFlags(t testing.TB, run examplesvc.RunFunc, argSets ...[]string) {
	t.Helper()
	for _, args := range argSets {
		var out, errOut bytes.Buffer
		require.Error(t, run(context.Background(), args, &out, &errOut), "args %q", args)
		require.Empty(t, out.String(), "args %q", args)
	}
}
