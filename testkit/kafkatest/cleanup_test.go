package kafkatest_test

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/testsvc"
)

// helperEnv makes the test binary act as a "test binary that dies": it
// starts a broker and a Connect worker, reports where they live, then waits
// to be killed.
const helperEnv = "KAFKATEST_CLEANUP_HELPER"

func helperMain(string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b, err := kafkatest.Start(ctx, kafkatest.Options{Local: true})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	c, err := kafkatest.StartConnect(ctx, b.Brokers(), kafkatest.ConnectOptions{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	fmt.Printf("READY %s %s\n", b.Dir(), c.Dir())
	time.Sleep(time.Hour)
	return 0
}

// TestCleanupWhenTestBinaryDies SIGKILLs a test binary that runs a broker
// and a Connect worker: the watchdogs must kill both JVMs and remove their
// directories. (pgtest tests SIGTERM and panics for the shared mechanism.)
func TestCleanupWhenTestBinaryDies(t *testing.T) {
	t.Parallel()
	h := testsvc.StartHelperBinary(t, helperEnv, "kill", 5*time.Minute)
	require.Len(t, h.Dirs, 2, "the broker's and the worker's; stderr:\n%s", h.Stderr())
	before := testsvc.ProcessesIn(h.Dirs)
	require.Len(t, before, 2, "a broker JVM and a Connect JVM in %v", h.Dirs)

	began := time.Now()
	require.NoError(t, h.Signal(syscall.SIGKILL))
	_ = h.Wait()
	h.RequireGone(t, 20*time.Second)
	t.Logf("JVMs %v and %v gone %v after the test binary was SIGKILLed", before, h.Dirs, time.Since(began).Round(time.Millisecond))
}
