package metrictest

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

func TestSum(t *testing.T) {
	t.Parallel()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	meter := mp.Meter("test")
	c, err := meter.Int64Counter("c")
	require.NoError(t, err)
	g, err := meter.Int64Gauge("g")
	require.NoError(t, err)
	ctx := context.Background()
	a := attribute.String("reason", "a")
	b := attribute.String("reason", "b")
	topic := attribute.String("topic", "t")
	c.Add(ctx, 1, metric.WithAttributes(a, topic))
	c.Add(ctx, 2, metric.WithAttributes(a))
	c.Add(ctx, 4, metric.WithAttributes(b))
	g.Record(ctx, 8, metric.WithAttributes(a))

	cases := []struct {
		name  string
		inst  string
		want  []attribute.KeyValue
		total int64
	}{
		{"every series", "c", nil, 7},
		{"one attribute, other attributes ignored", "c", []attribute.KeyValue{a}, 3},
		{"two attributes", "c", []attribute.KeyValue{a, topic}, 1},
		{"no series matches", "c", []attribute.KeyValue{attribute.String("reason", "z")}, 0},
		{"a gauge", "g", []attribute.KeyValue{a}, 8},
		{"no such instrument", "nope", nil, 0},
	}
	for _, tc := range cases {
		require.Equal(t, tc.total, Sum(t, reader, tc.inst, tc.want...), tc.name)
	}
}
