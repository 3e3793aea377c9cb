package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/examplesvc"
	"github.com/caughtup/caughtup/testkit/examplesvc/exampletest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the program with each relay on the demo's cluster with a
// Kafka broker, in a database of its own. The subtests run one after
// another: they pause and resume replay on the same replicas.
func TestRun(t *testing.T) {
	c := exampletest.Start(t, examplesvc.Options{Kafka: true})
	for _, relay := range []string{"polling", "logical"} {
		want := "relay=" + relay + " events=20 delivered=20 stale=0 lost=0\n"
		// Replay paused at random: no event reads a replica that lacks
		// its order, and none is lost.
		t.Run(relay+"/random-pauses", func(t *testing.T) {
			stdout, _ := exampletest.Run(t, c, time.Second, run, exampletest.Env(t, c), "-relay", relay)
			require.Equal(t, want, stdout)
		})
		// Replay paused on every replica throughout: every event's token
		// is ahead of them, and Sticky sends every event to the primary.
		t.Run(relay+"/replicas-paused-sticky", func(t *testing.T) {
			getenv := exampletest.Env(t, c)
			for _, n := range c.PG.Replicas() {
				require.NoError(t, n.PauseReplay(t.Context()))
				t.Cleanup(func() { require.NoError(t, n.ResumeReplay(context.Background())) })
			}
			stdout, stderr := exampletest.Run(t, c, 0, run, getenv, "-relay", relay, "-policy", "sticky")
			require.Equal(t, want, stdout)
			require.Contains(t, stderr, "reads: replica=0 primary=20 ")
		})
		// Replay streaming: Delayed waits the few milliseconds until a
		// replica has the order, and every event reads a replica.
		t.Run(relay+"/replicas-streaming-delayed", func(t *testing.T) {
			stdout, stderr := exampletest.Run(t, c, 0, run, exampletest.Env(t, c), "-relay", relay)
			require.Equal(t, want, stdout)
			require.Contains(t, stderr, "reads: replica=20 primary=0 ")
		})
	}
}

func TestBadFlags(t *testing.T) {
	exampletest.BadFlags(t, run, []string{"-relay", "nonsense"}, []string{"-policy", "nonsense"}, []string{"-events", "0"}, []string{"-nonsense"})
}

func TestMissingEnv(t *testing.T) {
	exampletest.MissingEnv(t, run, map[string]string{
		"CAUGHTUP_PRIMARY_URL":  "postgres://localhost/x",
		"CAUGHTUP_REPLICA_URLS": "postgres://localhost/x",
		"KAFKA_BROKERS":         "localhost:9092",
	})
}
