package kafka

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestResultString(t *testing.T) {
	t.Parallel()
	for r, want := range map[result]string{
		resultHandled:      "handled",
		resultWaited:       "waited",
		resultDeferred:     "deferred",
		resultRetried:      "retried",
		resultDeadLettered: "dead_lettered",
		resultDropped:      "dropped",
		resultWoken:        "woken",
		resultRerouted:     "rerouted",
		result(200):        "result(200)",
	} {
		require.Equal(t, want, r.String())
	}
}
