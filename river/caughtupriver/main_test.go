package caughtupriver_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

// TestMain shares one primary with two streaming replicas between the
// integration tests; each test uses its own database, with River's schema
// migrated into it. Tests that pause replay do not run in parallel: a
// paused replica stalls everyone's NewDatabase.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{Replicas: 2}))
}
