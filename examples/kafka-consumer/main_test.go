package main

import (
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/examplesvc"
	"github.com/caughtup/caughtup/testkit/examplesvc/exampletest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the example with each client on the demo's cluster with a
// Kafka broker, with replay paused at random, and checks its summary.
func TestRun(t *testing.T) {
	c := exampletest.Start(t, examplesvc.Options{Kafka: true})
	for _, client := range []string{"kafka-go", "franz-go"} {
		t.Run(client, func(t *testing.T) {
			stdout, stderr := exampletest.Run(t, c, time.Second, run, exampletest.Env(t, c), "-client", client, "-messages", "100")
			require.Equal(t, "messages=100 stale=0 lost=0 order_violations=0\n", stdout, "stderr:\n%s", stderr)
			// The consumer's counter, read after its Run returned, has
			// every message (more only if one ran twice).
			m := regexp.MustCompile(`consumer results: .*handled=(\d+)`).FindStringSubmatch(stderr)
			require.NotNil(t, m, "no consumer results on stderr:\n%s", stderr)
			handled, err := strconv.Atoi(m[1])
			require.NoError(t, err)
			require.GreaterOrEqual(t, handled, 100)
		})
	}
}

func TestBadFlags(t *testing.T) {
	exampletest.BadFlags(t, run, []string{"-messages", "0"}, []string{"-nonsense"}, []string{"-client", "sarama"})
}

func TestMissingEnv(t *testing.T) {
	exampletest.MissingEnv(t, run, map[string]string{
		"CAUGHTUP_PRIMARY_URL":  "postgres://localhost/x",
		"CAUGHTUP_REPLICA_URLS": "postgres://localhost/x",
		"KAFKA_BROKERS":         "localhost:9092",
	})
}
