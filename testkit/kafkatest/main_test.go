package kafkatest_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helperMain(mode))
	}
	// kafkatest outside pgtest: the Kafka services close after PostgreSQL,
	// but every connector (and so every slot) is gone by then, deleted in
	// its test's cleanup.
	goleak.VerifyTestMain(kafkatest.Wrap(
		pgtest.Wrap(m, pgtest.Options{Replicas: -1, Logf: verboseLogf}),
		kafkatest.Options{Logf: verboseLogf}))
}

// verboseLogf shows the shared services' progress (and start-up times)
// under -v only; they outlive any single test, so t.Logf will not do.
func verboseLogf(format string, args ...any) {
	if testing.Verbose() {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
	}
}

// testContext is bounded well below the package's time budget, so that a
// wedged broker fails one test with a message instead of the whole binary
// with a goroutine dump.
func testContext(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
