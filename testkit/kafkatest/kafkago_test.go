package kafkatest_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/kafkatest"
)

// produce writes n messages over keys k0..k(keys-1) the way the kafka
// adapter does: hash balancer (per-key order) and acks from all replicas.
func produce(t *testing.T, ctx context.Context, b *kafkatest.Broker, topic string, n, keys int) {
	t.Helper()
	tr := &kafka.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	w := &kafka.Writer{
		Addr:         kafka.TCP(b.Brokers()...),
		Topic:        topic,
		Balancer:     &kafka.Hash{},
		RequiredAcks: kafka.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		Transport:    tr,
	}
	msgs := make([]kafka.Message, n)
	for i := range msgs {
		msgs[i] = kafka.Message{Key: fmt.Appendf(nil, "k%d", i%keys), Value: fmt.Appendf(nil, "v%d", i)}
	}
	require.NoError(t, w.WriteMessages(ctx, msgs...))
	require.NoError(t, w.Close())
}

// partitionReader reads one partition from offset without a group.
func readPartition(t *testing.T, ctx context.Context, b *kafkatest.Broker, topic string, partition int, offset, end int64) []kafka.Message {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: b.Brokers(), Topic: topic, Partition: partition, MaxWait: 100 * time.Millisecond,
	})
	defer func() { require.NoError(t, r.Close()) }()
	require.NoError(t, r.SetOffset(offset))
	var out []kafka.Message
	for next := offset; next < end; next++ {
		m, err := r.ReadMessage(ctx)
		require.NoError(t, err, "partition %d offset %d", partition, next)
		out = append(out, m)
	}
	return out
}

// lockedLog collects kafka-go's log lines, written from its goroutines.
type lockedLog struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *lockedLog) printf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(&l.buf, format+"\n", args...)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func newClient(t *testing.T, b *kafkatest.Broker) *kafka.Client {
	tr := &kafka.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &kafka.Client{Addr: kafka.TCP(b.Brokers()...), Transport: tr, Timeout: 10 * time.Second}
}

// endOffsets is ListOffsets through kafka.Client (negotiated version).
func endOffsets(t *testing.T, ctx context.Context, c *kafka.Client, topic string, partitions int) map[int]int64 {
	t.Helper()
	var reqs []kafka.OffsetRequest
	for p := range partitions {
		reqs = append(reqs, kafka.FirstOffsetOf(p), kafka.LastOffsetOf(p))
	}
	resp, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	require.NoError(t, err)
	out := map[int]int64{}
	for _, po := range resp.Topics[topic] {
		require.NoError(t, po.Error)
		require.EqualValues(t, 0, po.FirstOffset)
		out[po.Partition] = po.LastOffset
	}
	require.Len(t, out, partitions)
	return out
}

// TestKafkaGoConsumerGroupAPI drives kafka-go's low-level ConsumerGroup /
// Generation API, which the kafka adapter's consumer is built on, against
// a real Kafka 4 broker. kafka-go v0.4.51 pins most versions: FindCoordinator
// v0, JoinGroup v2 (negotiated from v1-v2), SyncGroup v0, Heartbeat v0,
// OffsetFetch v1, OffsetCommit v2, LeaveGroup v0, ListOffsets v1 on a Conn;
// Client calls (ListOffsets, OffsetFetch, CreateTopics) negotiate. Kafka 4
// dropped older versions of several of these (KIP-896), three of them down
// to exactly what kafka-go sends; kfake does not enforce that.
func TestKafkaGoConsumerGroupAPI(t *testing.T) {
	t.Parallel()
	ctx := testContext(t, 2*time.Minute)
	b := kafkatest.Shared(t)
	topic, group := kafkatest.Name(t), kafkatest.Name(t)
	const partitions, n, keys = 3, 30, 10
	require.NoError(t, b.CreateTopic(ctx, topic, partitions))
	produce(t, ctx, b, topic, n, keys)

	client := newClient(t, b)
	ends := endOffsets(t, ctx, client, topic, partitions)
	var total int64
	for _, e := range ends {
		total += e
	}
	require.EqualValues(t, n, total)

	// Conn's ListOffsets is pinned to v1, Kafka 4's floor.
	conn, err := kafka.DialLeader(ctx, "tcp", b.Addr(), topic, 0)
	require.NoError(t, err)
	first, last, err := conn.ReadOffsets()
	require.NoError(t, err)
	require.NoError(t, conn.Close())
	require.EqualValues(t, 0, first)
	require.Equal(t, ends[0], last)

	// kafka-go's heartbeat loop (Heartbeat v0) stops silently on an error
	// and only says so in its log.
	var groupLog lockedLog
	join := func() (*kafka.ConsumerGroup, *kafka.Generation) {
		cg, err := kafka.NewConsumerGroup(kafka.ConsumerGroupConfig{
			ID: group, Brokers: b.Brokers(), Topics: []string{topic},
			// One member: no need to wait for others, and a quick exit.
			JoinGroupBackoff:  100 * time.Millisecond,
			HeartbeatInterval: 100 * time.Millisecond,
			Timeout:           10 * time.Second,
			Logger:            kafka.LoggerFunc(groupLog.printf),
		})
		require.NoError(t, err)
		for {
			gen, err := cg.Next(ctx)
			if err == nil {
				return cg, gen
			}
			// Transient while the group coordinator loads (the offsets
			// topic may have been created a moment ago): kafka-go hands
			// these to Next, and kafka/consumer.go retries them too.
			t.Logf("ConsumerGroup.Next: %v; retrying", err)
			require.NoError(t, ctx.Err())
		}
	}

	// First generation: nothing committed, so every partition starts at
	// FirstOffset; read everything, commit half of each partition.
	cg, gen := join()
	assigned := gen.Assignments[topic]
	require.Len(t, assigned, partitions)
	keyPartition := map[string]int{}
	committed := map[int]int64{}
	seen := 0
	for _, a := range assigned {
		require.Equal(t, kafka.FirstOffset, a.Offset, "partition %d: nothing committed yet", a.ID)
		msgs := readPartition(t, ctx, b, topic, a.ID, 0, ends[a.ID])
		for i, m := range msgs {
			require.EqualValues(t, i, m.Offset)
			if p, ok := keyPartition[string(m.Key)]; ok {
				require.Equal(t, p, a.ID, "hash balancer: key %s in two partitions", m.Key)
			}
			keyPartition[string(m.Key)] = a.ID
		}
		seen += len(msgs)
		committed[a.ID] = ends[a.ID] / 2
	}
	require.Equal(t, n, seen)
	require.Len(t, keyPartition, keys)
	// Deliberately idle for several heartbeat intervals: the member must
	// stay in the group (an OffsetCommit with its generation succeeds).
	time.Sleep(500 * time.Millisecond)
	require.NotContains(t, groupLog.String(), "stopped heartbeat")
	require.Contains(t, groupLog.String(), "started heartbeat")
	require.NoError(t, gen.CommitOffsets(map[string]map[int]int64{topic: committed}))
	require.NoError(t, cg.Close())

	// The commit is visible to OffsetFetch through the Client too.
	of, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: {0, 1, 2}}})
	require.NoError(t, err)
	require.NoError(t, of.Error)
	for _, p := range of.Topics[topic] {
		require.NoError(t, p.Error)
		require.Equal(t, committed[p.Partition], p.CommittedOffset, "partition %d", p.Partition)
	}

	// A new member of the same group resumes at the committed offsets.
	cg, gen = join()
	for _, a := range gen.Assignments[topic] {
		require.Equal(t, committed[a.ID], a.Offset, "partition %d resumes at its commit", a.ID)
	}
	require.NoError(t, cg.Close())
}

// TestKafkaGoGroupReader is the group Reader the kafka adapter's simple
// consumer uses: fetch, commit, close, and a new reader in the same group
// goes on exactly after what was committed.
func TestKafkaGoGroupReader(t *testing.T) {
	t.Parallel()
	ctx := testContext(t, 2*time.Minute)
	b := kafkatest.Shared(t)
	topic, group := kafkatest.Name(t), kafkatest.Name(t)
	const partitions, n, keys, firstBatch = 3, 30, 10, 10
	require.NoError(t, b.CreateTopic(ctx, topic, partitions))
	produce(t, ctx, b, topic, n, keys)

	newReader := func() *kafka.Reader {
		return kafka.NewReader(kafka.ReaderConfig{
			Brokers: b.Brokers(), GroupID: group, Topic: topic,
			StartOffset:      kafka.FirstOffset,
			MaxWait:          100 * time.Millisecond,
			JoinGroupBackoff: 100 * time.Millisecond,
			// CommitMessages commits synchronously.
			CommitInterval: 0,
		})
	}
	type pos struct {
		partition int
		offset    int64
	}
	got := map[pos]string{}
	fetch := func(r *kafka.Reader, count int) []kafka.Message {
		var out []kafka.Message
		for range count {
			m, err := r.FetchMessage(ctx)
			require.NoError(t, err)
			p := pos{m.Partition, m.Offset}
			_, dup := got[p]
			require.False(t, dup, "message %v delivered twice", p)
			got[p] = string(m.Value)
			out = append(out, m)
		}
		return out
	}

	r := newReader()
	msgs := fetch(r, firstBatch)
	require.NoError(t, r.CommitMessages(ctx, msgs...))
	require.NoError(t, r.Close())

	r = newReader()
	fetch(r, n-firstBatch)
	// Nothing more: the second reader began exactly at the commits.
	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	_, err := r.FetchMessage(short)
	cancel()
	require.True(t, errors.Is(err, context.DeadlineExceeded), "expected no further message, got %v", err)
	require.NoError(t, r.Close())

	values := make([]string, 0, len(got))
	for _, v := range got {
		values = append(values, v)
	}
	sort.Strings(values)
	require.Len(t, values, n)
}
