package caughtuphttp

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The shared cluster starts only when an integration test asks for it, and
// is closed before goleak looks for leftover goroutines.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{}))
}
