// Package metrictest reads what an OpenTelemetry SDK reader collected, for
// the tests of the packages that record metrics.
//
//	reader := sdkmetric.NewManualReader()
//	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
//	// … hand mp to the code under test, run it …
//	n := metrictest.Sum(t, reader, "caughtup.feed.rejected", attribute.String("caughtup.reason", "replayed"))
package metrictest

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Sum collects reader and adds up the int64 data points (sums and gauges)
// of instrument name whose attributes include every one of want; other
// attributes may differ. It is 0 when nothing matches.
func Sum(t testing.TB, reader sdkmetric.Reader, name string, want ...attribute.KeyValue) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	var total int64
	for _, sm := range rm.ScopeMetrics {
		for _, md := range sm.Metrics {
			if md.Name != name {
				continue
			}
			var points []metricdata.DataPoint[int64]
			switch d := md.Data.(type) {
			case metricdata.Sum[int64]:
				points = d.DataPoints
			case metricdata.Gauge[int64]:
				points = d.DataPoints
			}
			for _, p := range points {
				if hasAll(p.Attributes, want) {
					total += p.Value
				}
			}
		}
	}
	return total
}

func hasAll(set attribute.Set, want []attribute.KeyValue) bool {
	for _, kv := range want {
		if v, ok := set.Value(kv.Key); !ok || v != kv.Value {
			return false
		}
	}
	return true
}
