package enqueue_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

// TestMain shares one primary with two streaming replicas between the
// integration tests; each test uses its own database. Tests that pause
// replay do not run in parallel: a paused replica stalls NewDatabase and
// WaitReplicasCaughtUp for everyone.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{Replicas: 2}))
}
