package kafkatest_test

import (
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/kafkatest"
)

// TestBrokerKillAndRestart: what chaos will do to a broker. Acknowledged
// (acks=all) writes survive a SIGKILL of a broker that fsyncs nothing,
// because the page cache outlives the process; the restart reuses the
// ports, so clients configured before the crash reconnect. A restart after
// SIGKILL waits out the controller's session of the dead incarnation
// (broker.session.timeout.ms, 3 s here).
func TestBrokerKillAndRestart(t *testing.T) {
	t.Parallel()
	ctx := testContext(t, 4*time.Minute)
	b, err := kafkatest.Start(ctx, kafkatest.Options{Local: true, Logf: t.Logf})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	topic := kafkatest.Name(t)
	require.NoError(t, b.CreateTopic(ctx, topic, 1))
	produce(t, ctx, b, topic, 5, 5)
	addr := b.Addr()

	require.NoError(t, b.Kill())
	require.False(t, b.Running())
	_, err = kafka.DialContext(ctx, "tcp", addr)
	require.Error(t, err, "a killed broker refuses connections")

	began := time.Now()
	require.NoError(t, b.Start(ctx))
	t.Logf("restarted after SIGKILL in %v", time.Since(began).Round(time.Millisecond))
	require.Equal(t, addr, b.Addr())
	got := readPartition(t, ctx, b, topic, 0, 0, 5)
	require.Len(t, got, 5)

	require.NoError(t, b.Stop(ctx))
	require.NoError(t, b.Start(ctx))
	produce(t, ctx, b, topic, 1, 1)
	require.Len(t, readPartition(t, ctx, b, topic, 0, 0, 6), 6)
}
