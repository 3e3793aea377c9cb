package caughtupkafka_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// handledPoints returns the data points of caughtup.kafka.messages with
// result "handled" for topic.
func handledPoints(t *testing.T, e *env, topic string) []metricdata.DataPoint[int64] {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, e.Metrics.Collect(context.Background(), &rm))
	var out []metricdata.DataPoint[int64]
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "caughtup.kafka.messages" {
				continue
			}
			require.Equal(t, caughtupkafka.ScopeName, sm.Scope.Name)
			require.Equal(t, "{message}", m.Unit)
			sum, ok := m.Data.(metricdata.Sum[int64])
			require.True(t, ok, "caughtup.kafka.messages is a sum")
			require.True(t, sum.IsMonotonic)
			for _, dp := range sum.DataPoints {
				res, _ := dp.Attributes.Value("caughtup.kafka.result")
				dest, _ := dp.Attributes.Value("messaging.destination.name")
				sys, _ := dp.Attributes.Value("messaging.system")
				if res.AsString() == "handled" && dest.AsString() == topic {
					require.Equal(t, "kafka", sys.AsString())
					out = append(out, dp)
				}
			}
		}
	}
	return out
}

// TestMetricsOutliveRun: the counts of a consumer are still reported after
// its Run returned, and a second consumer on the same MeterProvider adds
// to the same series rather than reporting it twice.
func TestMetricsOutliveRun(t *testing.T) {
	t.Parallel()
	e := setupDB(t, nil)
	topic := kafkasuite.NewTopics(t, 2, "")[0]
	group := kafkasuite.NewGroup(t)
	ran := make(chan struct{}, 16)
	h := func(context.Context, kafka.Message) error {
		ran <- struct{}{}
		return nil
	}
	cfg := caughtupkafka.ConsumerConfig{Topic: topic, GroupID: group, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP}
	w := newWriter(t, topic)
	write := func(from, to int) {
		var msgs []kafka.Message
		for i := from; i < to; i++ {
			msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(i)), Value: []byte("x")})
		}
		require.NoError(t, w.WriteMessages(t.Context(), msgs...))
		for range to - from {
			wait(t, ran, "a message's run")
		}
	}

	first := startConsumer(t, cfg, h)
	write(0, 5)
	require.NoError(t, first.Stop())
	dps := handledPoints(t, e, topic)
	require.Len(t, dps, 1)
	require.Equal(t, int64(5), dps[0].Value, "the counts are gone once Run returned")

	second := startConsumer(t, cfg, h)
	write(5, 8)
	require.NoError(t, second.Stop())
	dps = handledPoints(t, e, topic)
	require.Len(t, dps, 1, "two consumers one after the other report one series")
	require.Equal(t, int64(8), dps[0].Value)
}
