package redistest_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// A go-redis pool that failed to dial a killed server retries from a
// goroutine that sleeps 1s between attempts and ends at its next wake
// after the client closed: not a leak.
func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helperMain(mode))
	}
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"))
}
