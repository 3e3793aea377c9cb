package caughtupkgo_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Tests run against a real Apache Kafka 4 broker (single node, KRaft),
// started once per test binary by testkit/kafkatest, or against the
// cluster KAFKA_BROKERS names, and the real replicated PostgreSQL cluster
// of testkit/pgtest. Every test creates its own uniquely named topics and
// groups, so they share the broker. KAFKA_REPLICATION_FACTOR sets the
// topics' replication factor (default 1).

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(kafkatest.Wrap(pgtest.Wrap(m, pgtest.Options{}), kafkatest.Options{
		// Kafka refuses session timeouts under 6s by default; the
		// rebalance tests let a dead member's partitions move on quickly.
		Settings: map[string]string{"group.min.session.timeout.ms": "1000"},
	}))
}

// brokers returns the shared broker's (or KAFKA_BROKERS') addresses.
func brokers(t testing.TB) []string {
	t.Helper()
	return kafkatest.Shared(t).Brokers()
}

// newClient returns a franz-go client on the test broker, closed at
// cleanup.
func newClient(t testing.TB, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers(t)...)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return cl
}

var topicSeq atomic.Int64

var unsafeTopic = regexp.MustCompile(`[^a-zA-Z0-9_-]+`)

// newTopics creates len(suffixes) topics of partitions partitions named
// after the test, unique per run, and returns their names: the first
// suffix is usually "" (the main topic), then ".retry", ".dlt".
func newTopics(t testing.TB, partitions int, suffixes ...string) []string {
	t.Helper()
	base := fmt.Sprintf("caughtup-kgo-%s-%d-%d", unsafeTopic.ReplaceAllString(t.Name(), "_"),
		time.Now().UnixNano()%1e9, topicSeq.Add(1))
	if len(base) > 200 {
		base = base[len(base)-200:]
	}
	rf := int16(1)
	if s := os.Getenv("KAFKA_REPLICATION_FACTOR"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(t, err, "KAFKA_REPLICATION_FACTOR")
		rf = int16(n)
	}
	cl := newClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req := kmsg.NewPtrCreateTopicsRequest()
	req.TimeoutMillis = 10000
	names := make([]string, len(suffixes))
	for i, s := range suffixes {
		names[i] = base + s
		rt := kmsg.NewCreateTopicsRequestTopic()
		rt.Topic, rt.NumPartitions, rt.ReplicationFactor = names[i], int32(partitions), rf
		req.Topics = append(req.Topics, rt)
	}
	resp, err := req.RequestWith(ctx, cl)
	require.NoError(t, err, "creating topics %v", names)
	for _, rt := range resp.Topics {
		require.NoError(t, kerr.ErrorForCode(rt.ErrorCode), "creating topic %s", rt.Topic)
	}
	// A new topic reaches every broker's metadata a little later; a group
	// that joins before would get no partitions.
	require.Eventually(t, func() bool {
		md := kmsg.NewPtrMetadataRequest()
		for _, n := range names {
			mt := kmsg.NewMetadataRequestTopic()
			mt.Topic = kmsg.StringPtr(n)
			md.Topics = append(md.Topics, mt)
		}
		resp, err := md.RequestWith(ctx, cl)
		if err != nil || len(resp.Topics) != len(names) {
			return false
		}
		for _, tp := range resp.Topics {
			if tp.ErrorCode != 0 || len(tp.Partitions) != partitions {
				return false
			}
			for _, p := range tp.Partitions {
				if p.ErrorCode != 0 || p.Leader < 0 {
					return false
				}
			}
		}
		return true
	}, 15*time.Second, 20*time.Millisecond, "topics %v never showed all their partitions", names)
	if os.Getenv("KAFKA_BROKERS") != "" {
		t.Cleanup(func() {
			cl := newClientNoCleanup(t)
			defer cl.Close()
			req := kmsg.NewPtrDeleteTopicsRequest()
			req.TopicNames = names
			_, _ = req.RequestWith(context.Background(), cl)
		})
	}
	return names
}

func newClientNoCleanup(t testing.TB) *kgo.Client {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers(t)...))
	require.NoError(t, err)
	return cl
}

var groupSeq atomic.Int64

func newGroup(t testing.TB) string {
	return fmt.Sprintf("caughtup-kgo-test-%d-%d", time.Now().UnixNano()%1e9, groupSeq.Add(1))
}

// countRecords returns how many records topic holds (end minus start
// offsets over its partitions).
func countRecords(ctx context.Context, t testing.TB, topic string) (int, error) {
	cl := newClient(t)
	n := 0
	for _, ts := range []int64{-2, -1} { // earliest, latest
		req := kmsg.NewPtrListOffsetsRequest()
		rt := kmsg.NewListOffsetsRequestTopic()
		rt.Topic = topic
		md := kmsg.NewPtrMetadataRequest()
		mt := kmsg.NewMetadataRequestTopic()
		mt.Topic = kmsg.StringPtr(topic)
		md.Topics = append(md.Topics, mt)
		mresp, err := md.RequestWith(ctx, cl)
		if err != nil {
			return 0, err
		}
		if len(mresp.Topics) != 1 || mresp.Topics[0].ErrorCode != 0 {
			return 0, fmt.Errorf("metadata of %s: %v", topic, kerr.ErrorForCode(mresp.Topics[0].ErrorCode))
		}
		for _, p := range mresp.Topics[0].Partitions {
			rp := kmsg.NewListOffsetsRequestTopicPartition()
			rp.Partition, rp.Timestamp, rp.CurrentLeaderEpoch = p.Partition, ts, -1
			rt.Partitions = append(rt.Partitions, rp)
		}
		req.Topics = append(req.Topics, rt)
		resp, err := req.RequestWith(ctx, cl)
		if err != nil {
			return 0, err
		}
		for _, tr := range resp.Topics {
			for _, pr := range tr.Partitions {
				if err := kerr.ErrorForCode(pr.ErrorCode); err != nil {
					return 0, fmt.Errorf("offsets of %s[%d]: %w", topic, pr.Partition, err)
				}
				if ts == -2 {
					n -= int(pr.Offset)
				} else {
					n += int(pr.Offset)
				}
			}
		}
	}
	return n, nil
}
