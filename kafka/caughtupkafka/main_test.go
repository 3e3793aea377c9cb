package caughtupkafka_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Tests run against a real Apache Kafka 4 broker (single node, KRaft),
// started once per test binary by testkit/kafkatest, or against the
// cluster KAFKA_BROKERS names (comma-separated host:port). Every test
// creates its own uniquely named topics and groups, so they share the
// broker. KAFKA_REPLICATION_FACTOR sets the topics' replication factor
// (default 1).

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(kafkatest.Wrap(pgtest.Wrap(m, pgtest.Options{}), kafkatest.Options{
		// Kafka refuses session timeouts under 6s by default; the kill
		// tests let a dead member's partitions move on within 2s
		// (killable).
		Settings: map[string]string{"group.min.session.timeout.ms": "1000"},
	}))
}

// brokers returns the shared broker's (or KAFKA_BROKERS') addresses.
func brokers(t testing.TB) []string {
	t.Helper()
	return kafkatest.Shared(t).Brokers()
}

var topicSeq atomic.Int64

var unsafeTopic = regexp.MustCompile(`[^a-zA-Z0-9_-]+`)

// newTopics creates len(suffixes) topics of partitions partitions named
// after the test, unique per run, and returns their names: the first
// suffix is usually "" (the main topic), then ".retry", ".dlt".
func newTopics(t testing.TB, partitions int, suffixes ...string) []string {
	t.Helper()
	base := fmt.Sprintf("caughtup-%s-%d-%d", unsafeTopic.ReplaceAllString(t.Name(), "_"),
		time.Now().UnixNano()%1e9, topicSeq.Add(1))
	if len(base) > 200 {
		base = base[len(base)-200:]
	}
	rf := 1
	if s := os.Getenv("KAFKA_REPLICATION_FACTOR"); s != "" {
		var err error
		rf, err = strconv.Atoi(s)
		require.NoError(t, err, "KAFKA_REPLICATION_FACTOR")
	}
	names := make([]string, len(suffixes))
	cfgs := make([]kafka.TopicConfig, len(suffixes))
	for i, s := range suffixes {
		names[i] = base + s
		cfgs[i] = kafka.TopicConfig{Topic: names[i], NumPartitions: partitions, ReplicationFactor: rf}
	}
	bs := brokers(t)
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(bs...), Transport: tr, Timeout: 10 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: cfgs})
	require.NoError(t, err, "creating topics %v", names)
	for name, err := range resp.Errors {
		require.NoError(t, err, "creating topic %s", name)
	}
	// A real cluster propagates new topics to every broker's metadata a
	// little later; a group that joins before would get no partitions.
	require.Eventually(t, func() bool {
		md, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: names})
		if err != nil || len(md.Topics) != len(names) {
			return false
		}
		for _, tp := range md.Topics {
			if tp.Error != nil || len(tp.Partitions) != partitions {
				return false
			}
			for _, p := range tp.Partitions {
				if p.Error != nil || p.Leader.Host == "" {
					return false
				}
			}
		}
		return true
	}, 15*time.Second, 20*time.Millisecond, "topics %v never showed all their partitions", names)
	if os.Getenv("KAFKA_BROKERS") != "" {
		t.Cleanup(func() {
			tr := &kafka.Transport{}
			defer tr.CloseIdleConnections()
			cl := &kafka.Client{Addr: kafka.TCP(bs...), Transport: tr, Timeout: 10 * time.Second}
			_, _ = cl.DeleteTopics(context.Background(), &kafka.DeleteTopicsRequest{Topics: names})
		})
	}
	return names
}

// newWriter returns a kafka-go Writer with the settings the package
// documentation asks for, tuned for tests (5ms batches), closed at cleanup.
func newWriter(t testing.TB, topic string) *kafka.Writer {
	t.Helper()
	tr := &kafka.Transport{}
	w := &kafka.Writer{
		Addr:         kafka.TCP(brokers(t)...),
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

var groupSeq atomic.Int64

func newGroup(t testing.TB) string {
	return fmt.Sprintf("caughtup-test-%d-%d", time.Now().UnixNano()%1e9, groupSeq.Add(1))
}
