// Package exampletest runs an example program from its test, the way each
// examples/*/main_test.go does: on a cluster of the test's own
// (examplesvc), in a database of the test's own, with replay paused at
// random if the test asks.
package exampletest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/examplesvc"
)

// RunFunc is an example's program: flags in args, its services from
// getenv, its summary on stdout, progress and details on stderr.
type RunFunc func(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error

// Start starts a cluster for the test and closes it when the test ends.
// A service that cannot start fails the test; it never skips.
func Start(t testing.TB, opts examplesvc.Options) *examplesvc.Cluster {
	t.Helper()
	opts.Logf = t.Logf
	c, err := examplesvc.Start(t.Context(), opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

var dbCounter atomic.Int64

// Env creates a database of the test's own on c and returns the
// environment of an example that uses it.
func Env(t testing.TB, c *examplesvc.Cluster) func(string) string {
	t.Helper()
	name := fmt.Sprintf("example_%d", dbCounter.Add(1))
	require.NoError(t, c.PG.CreateDatabase(t.Context(), name))
	return c.Getenv(name)
}

// Run runs the program with args and returns what it printed, while
// replay on c's replicas pauses at random for up to maxPause at a time
// (0: never). It fails the test, with stderr, if the program fails, and
// logs stderr otherwise: where the messages ran varies from run to run and
// is worth seeing.
func Run(t testing.TB, c *examplesvc.Cluster, maxPause time.Duration, run RunFunc, getenv func(string) string, args ...string) (stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	stop := c.PauseReplay(t.Context(), maxPause, t.Logf)
	err := run(t.Context(), args, getenv, &out, &errOut)
	stop()
	require.NoError(t, err, "stderr:\n%s", errOut.String())
	t.Logf("stdout: %sstderr:\n%s", out.String(), errOut.String())
	return out.String(), errOut.String()
}

// BadFlags checks that the program refuses each set of arguments before it
// starts anything, printing nothing on stdout.
func BadFlags(t testing.TB, run RunFunc, argSets ...[]string) {
	t.Helper()
	for _, args := range argSets {
		var out, errOut bytes.Buffer
		require.Error(t, run(context.Background(), args, func(string) string { return "" }, &out, &errOut), "args %q", args)
		require.Empty(t, out.String(), "args %q", args)
	}
}

// MissingEnv checks that the program, given every variable it reads but
// one, fails before it connects to anything, with an error that names the
// missing one. vars are the variables it reads, with values that parse.
func MissingEnv(t testing.TB, run RunFunc, vars map[string]string) {
	t.Helper()
	for missing := range vars {
		getenv := func(k string) string {
			if k == missing {
				return ""
			}
			return vars[k]
		}
		var out, errOut bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := run(ctx, nil, getenv, &out, &errOut)
		cancel()
		require.Error(t, err, "without %s", missing)
		require.True(t, strings.Contains(err.Error(), missing), "the error without %s does not name it: %v", missing, err)
		require.Empty(t, out.String(), "without %s", missing)
	}
}
