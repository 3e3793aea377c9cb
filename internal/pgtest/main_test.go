package pgtest_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/internal/pgtest"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helperMain(mode))
	}
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{Logf: verboseLogf}))
}

// verboseLogf shows the shared cluster's progress under -v only; it outlives
// any single test, so it cannot use t.Logf.
func verboseLogf(format string, args ...any) {
	if testing.Verbose() {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
	}
}

// setup returns the shared cluster, a fresh database on it and a context
// bounded well below the package's time budget.
func setup(t *testing.T) (*pgtest.Cluster, string, context.Context) {
	t.Helper()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c, db, ctx
}
