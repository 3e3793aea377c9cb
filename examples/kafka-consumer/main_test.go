package main

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the example on its own cluster and broker (or on the
// services the environment names) and checks its summary.
func TestRun(t *testing.T) {
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), []string{"-messages", "100"}, &stdout, &stderr)
	require.NoError(t, err, "stderr:\n%s", stderr.String())
	require.Equal(t, "messages=100 stale=0 lost=0 order_violations=0\n", stdout.String(), "stderr:\n%s", stderr.String())
	// The consumer's counter, read after its Run returned, has every
	// message (more only if one ran twice).
	m := regexp.MustCompile(`consumer results: .*handled=(\d+)`).FindStringSubmatch(stderr.String())
	require.NotNil(t, m, "no consumer results on stderr:\n%s", stderr.String())
	handled, err := strconv.Atoi(m[1])
	require.NoError(t, err)
	require.GreaterOrEqual(t, handled, 100)
	t.Logf("stderr:\n%s", stderr.String())
}

func TestBadFlags(t *testing.T) {
	var stdout, stderr bytes.Buffer
	require.Error(t, run(context.Background(), []string{"-messages", "0"}, &stdout, &stderr))
	require.Empty(t, stdout.String())
}
