package caughtupkgo_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// Tests run against a real Apache Kafka 4 broker (single node, KRaft),
// started once per test binary by testkit/kafkatest, or against the
// cluster KAFKA_BROKERS names, and the real replicated PostgreSQL cluster
// of testkit/pgtest. Every test creates its own uniquely named topics and
// groups (kafkasuite.NewTopics, kafkasuite.NewGroup), so they share the
// broker.

func TestMain(m *testing.M) { kafkasuite.Main(m) }

// newClient returns a franz-go client on the test broker, closed at
// cleanup.
func newClient(t testing.TB, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(kafkasuite.Brokers(t)...)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return cl
}
