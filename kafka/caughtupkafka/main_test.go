package caughtupkafka_test

import (
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// Tests run against a real Apache Kafka 4 broker (single node, KRaft),
// started once per test binary by testkit/kafkatest, or against the
// cluster KAFKA_BROKERS names (comma-separated host:port), and the real
// replicated PostgreSQL cluster of testkit/pgtest. Every test creates its
// own uniquely named topics and groups (kafkasuite.NewTopics,
// kafkasuite.NewGroup), so they share the broker.

func TestMain(m *testing.M) { kafkasuite.Main(m) }

// newWriter returns a kafka-go Writer with the settings the package
// documentation asks for, tuned for tests (5ms batches), closed at cleanup.
func newWriter(t testing.TB, topic string) *kafka.Writer {
	t.Helper()
	tr := &kafka.Transport{}
	w := &kafka.Writer{
		Addr:         kafka.TCP(kafkasuite.Brokers(t)...),
		Topic:        topic,
		Balancer:     &kafka.Hash{},
		RequiredAcks: kafka.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		Transport:    tr,
	}
	t.Cleanup(func() {
		require.NoError(t, w.Close())
		tr.CloseIdleConnections()
	})
	return w
}
