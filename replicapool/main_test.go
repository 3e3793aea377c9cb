package replicapool

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{}))
}
