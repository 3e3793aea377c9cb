package main

import (
	"bytes"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(clusterHelper())
	}
	goleak.VerifyTestMain(m,
		// kafka-go's shared DefaultTransport keeps idle broker
		// connections of the Writer's metadata requests; they are not
		// ours to stop.
		goleak.IgnoreTopFunction("github.com/segmentio/kafka-go.(*conn).run"),
		goleak.IgnoreTopFunction("github.com/segmentio/kafka-go.(*connPool).discover"),
	)
}

// The demo's promise on a short run: with caughtup nothing is stale or
// lost through a lag spike and a failover; without it the same traffic
// reads stale data.
func TestDemoShowsTheProblemAndTheFix(t *testing.T) {
	var out bytes.Buffer
	res, err := Run(t.Context(), Options{
		Out: &out, Duration: 12 * time.Second, Rate: 50,
		SpikeAt: 2 * time.Second, SpikeFor: 3 * time.Second, FailoverAt: 7 * time.Second,
	})
	t.Log("\n" + out.String())
	require.NoError(t, err)
	require.Positive(t, res.Requests)
	require.Zero(t, res.Caughtup.Stale, "stale reads with caughtup")
	require.Zero(t, res.Caughtup.Lost, "lost with caughtup")
	require.Zero(t, res.Without.Lost, "lost without caughtup")
	require.Positive(t, res.Without.Stale, "the lag spike produced no stale read without caughtup: the demo shows nothing")
	require.Equal(t, uint32(2), res.TimelineB, "the failover happened")
	require.Contains(t, out.String(), "OK: no stale read")
}
