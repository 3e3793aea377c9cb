package main

import (
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/examplesvc"
	"github.com/caughtup/caughtup/testkit/examplesvc/exampletest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the example on the demo's cluster with a Kafka broker and a
// Connect worker, with replay paused at random, and checks its summary,
// and that it deleted its connector.
func TestRun(t *testing.T) {
	c := exampletest.Start(t, examplesvc.Options{Debezium: true})
	getenv := exampletest.Env(t, c)
	stdout, stderr := exampletest.Run(t, c, time.Second, run, getenv, "-transactions", "200")
	require.Regexp(t, regexp.MustCompile(`^changes=\d+ stale=0 lost=0 order_violations=0\n$`), stdout, "stderr:\n%s", stderr)
	require.Contains(t, stderr, "commit-safe checks on replicas", "stderr:\n%s", stderr)
	connectors, err := connectRequest(t.Context(), http.MethodGet, getenv("KAFKA_CONNECT_URL")+"/connectors", nil)
	require.NoError(t, err)
	require.JSONEq(t, "[]", string(connectors), "connectors left behind")
}

func TestBadFlags(t *testing.T) {
	exampletest.BadFlags(t, run, []string{"-transactions", "0"}, []string{"-nonsense"})
}

func TestMissingEnv(t *testing.T) {
	exampletest.MissingEnv(t, run, map[string]string{
		"CAUGHTUP_PRIMARY_URL":  "postgres://localhost/x",
		"CAUGHTUP_REPLICA_URLS": "postgres://localhost/x",
		"KAFKA_BROKERS":         "localhost:9092",
		"KAFKA_CONNECT_URL":     "http://localhost:8083",
	})
}
