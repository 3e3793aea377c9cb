package main

import (
	"context"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/examplesvc/exampletest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRun runs the program's logic with each relay on services of its own
// (a PostgreSQL primary with one streaming replica, an Apache Kafka broker;
// or the brokers $KAFKA_BROKERS names) and checks the summary line, which
// is deterministic: with replay paused every event must read the primary,
// once it streams every event reads the replica, and no read is stale.
func TestRun(t *testing.T) {
	for _, relay := range []string{"polling", "logical"} {
		t.Run(relay, func(t *testing.T) {
			t.Parallel()
			stdout, _ := exampletest.Run(t, func(ctx context.Context, _ []string, stdout, stderr io.Writer) error {
				return run(ctx, stdout, stderr, config{Relay: relay})
			})
			want := "outbox-relay: relay=" + relay + " events=20 delivered=20 | replica paused, sticky: replica=0 primary=10 | replica streaming, delayed: replica=10 primary=0 | stale reads=0\n"
			require.Equal(t, want, stdout)
		})
	}
}

func TestBadConfig(t *testing.T) {
	for _, cfg := range []config{{Relay: "nonsense"}, {PrimaryDSN: "postgres://localhost/x"}} {
		require.Error(t, run(context.Background(), io.Discard, io.Discard, cfg), "%+v", cfg)
	}
}
