package caughtupkafka_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// TestUnstampedAtLeastOnce: messages without a token (written by a plain
// kafka-go writer) run on the primary, every message once, each key in
// order, committed on stop so that a second consumer in the group reads
// nothing again.
func TestUnstampedAtLeastOnce(t *testing.T) {
	t.Parallel()
	e := setupDB(t, nil)
	const n, keys = 1000, 10
	topic := kafkasuite.NewTopics(t, 4, "")[0]
	var msgs []kafka.Message
	for i := range n {
		msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(i % keys)), Value: []byte(strconv.Itoa(i))})
	}
	require.NoError(t, newWriter(t, topic).WriteMessages(t.Context(), msgs...))

	var mu sync.Mutex
	seen := map[int]int{}
	last := map[string]int{}
	var violations, notPrimary int
	handle := func(ctx context.Context, m kafka.Message) error {
		i, err := strconv.Atoi(string(m.Value))
		require.NoError(t, err)
		dec, _ := consume.DecisionFrom(ctx)
		mu.Lock()
		defer mu.Unlock()
		if dec.Outcome != consume.OutcomePrimaryNoToken || consume.DB(ctx, "main") != e.Primary {
			notPrimary++
		}
		if p, ok := last[string(m.Key)]; ok && p >= i {
			violations++
		}
		last[string(m.Key)] = i
		seen[i]++
		return nil
	}
	group := kafkasuite.NewGroup(t)
	r := startConsumer(t, caughtupkafka.ConsumerConfig{Topic: topic, GroupID: group, Router: e.Router}, handle)
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) == n }, 30*time.Second, 10*time.Millisecond)
	require.NoError(t, r.Stop())

	again := startConsumer(t, caughtupkafka.ConsumerConfig{Topic: topic, GroupID: group, Router: e.Router}, handle)
	require.NoError(t, newWriter(t, topic).WriteMessages(t.Context(), kafka.Message{Key: []byte("0"), Value: []byte(strconv.Itoa(n))}))
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) == n+1 }, 30*time.Second, 10*time.Millisecond)
	require.NoError(t, again.Stop())
	mu.Lock()
	defer mu.Unlock()
	for i := range n + 1 {
		require.Equal(t, 1, seen[i], "message %d", i)
	}
	require.Zero(t, violations)
	require.Zero(t, notPrimary, "a message without a token read elsewhere than the primary")
}
