package kafkasuite

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/kafkatest"
)

// Brokers returns the shared broker's (or KAFKA_BROKERS') addresses.
func Brokers(t testing.TB) []string {
	t.Helper()
	return kafkatest.Shared(t).Brokers()
}

var topicSeq, groupSeq atomic.Int64

var unsafeTopic = regexp.MustCompile(`[^a-zA-Z0-9_-]+`)

// admin is a kafka-go client on the test brokers for topic administration.
func admin(t testing.TB) (*kafkago.Client, func()) {
	tr := &kafkago.Transport{}
	return &kafkago.Client{Addr: kafkago.TCP(Brokers(t)...), Transport: tr, Timeout: 10 * time.Second}, tr.CloseIdleConnections
}

// NewTopics creates len(suffixes) topics of partitions partitions named
// after the test, unique per run, and returns their names: the first
// suffix is usually "" (the main topic), then ".retry", ".dlt".
// KAFKA_REPLICATION_FACTOR sets their replication factor (default 1). On
// a KAFKA_BROKERS cluster they are deleted at cleanup.
func NewTopics(t testing.TB, partitions int, suffixes ...string) []string {
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
	cfgs := make([]kafkago.TopicConfig, len(suffixes))
	for i, s := range suffixes {
		names[i] = base + s
		cfgs[i] = kafkago.TopicConfig{Topic: names[i], NumPartitions: partitions, ReplicationFactor: rf}
	}
	cl, done := admin(t)
	defer done()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, err := cl.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: cfgs})
	require.NoError(t, err, "creating topics %v", names)
	for name, err := range resp.Errors {
		require.NoError(t, err, "creating topic %s", name)
	}
	// A real cluster propagates new topics to every broker's metadata a
	// little later; a group that joins before would get no partitions.
	require.Eventually(t, func() bool {
		md, err := cl.Metadata(ctx, &kafkago.MetadataRequest{Topics: names})
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
			cl, done := admin(t)
			defer done()
			_, _ = cl.DeleteTopics(context.Background(), &kafkago.DeleteTopicsRequest{Topics: names})
		})
	}
	return names
}

// NewGroup returns a consumer group name unique in this test binary.
func NewGroup(t testing.TB) string {
	return fmt.Sprintf("caughtup-test-%d-%d", time.Now().UnixNano()%1e9, groupSeq.Add(1))
}

// CountRecords returns how many records topic holds (end minus start
// offsets over its partitions).
func CountRecords(ctx context.Context, t testing.TB, topic string) (int, error) {
	cl, done := admin(t)
	defer done()
	md, err := cl.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return 0, err
	}
	if len(md.Topics) != 1 || md.Topics[0].Error != nil {
		return 0, fmt.Errorf("metadata of %s: %+v", topic, md.Topics)
	}
	var reqs []kafkago.OffsetRequest
	for _, p := range md.Topics[0].Partitions {
		reqs = append(reqs, kafkago.FirstOffsetOf(p.ID), kafkago.LastOffsetOf(p.ID))
	}
	resp, err := cl.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: reqs}})
	if err != nil {
		return 0, err
	}
	n := 0
	for _, po := range resp.Topics[topic] {
		if po.Error != nil {
			return 0, fmt.Errorf("offsets of %s[%d]: %w", topic, po.Partition, po.Error)
		}
		n += int(po.LastOffset - po.FirstOffset)
	}
	return n, nil
}
