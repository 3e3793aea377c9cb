package kafka

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestResultString(t *testing.T) {
	t.Parallel()
	for r, want := range map[Result]string{
		Handled:      "handled",
		Waited:       "waited",
		Deferred:     "deferred",
		Retried:      "retried",
		DeadLettered: "dead_lettered",
		Dropped:      "dropped",
		Woken:        "woken",
		Result(200):  "result(200)",
	} {
		require.Equal(t, want, r.String())
	}
}
