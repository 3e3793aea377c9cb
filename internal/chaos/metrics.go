package chaos

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// runMetrics is one scenario's MeterProvider, read on demand: the router,
// the asynq middleware and the Kafka consumer of the scenario record into
// it, so that a check can read what the library counted (the asynq
// middleware's overrides, say) without a global provider shared with the
// other scenarios.
type runMetrics struct {
	reader   *sdkmetric.ManualReader
	provider *sdkmetric.MeterProvider
}

func newRunMetrics() *runMetrics {
	reader := sdkmetric.NewManualReader()
	return &runMetrics{reader: reader, provider: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}
}

// sum returns an Int64 counter's value per value of the attribute attr
// (all data points when attr is ""; they then sum under "").
func (m *runMetrics) sum(name, attr string) map[string]int64 {
	out := map[string]int64{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var rm metricdata.ResourceMetrics
	if err := m.reader.Collect(ctx, &rm); err != nil {
		return out
	}
	for _, sm := range rm.ScopeMetrics {
		for _, mt := range sm.Metrics {
			if mt.Name != name {
				continue
			}
			s, ok := mt.Data.(metricdata.Sum[int64])
			if !ok {
				continue
			}
			for _, dp := range s.DataPoints {
				key := ""
				if attr != "" {
					v, _ := dp.Attributes.Value(attribute.Key(attr))
					key = v.Emit()
				}
				out[key] += dp.Value
			}
		}
	}
	return out
}

func (m *runMetrics) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = m.provider.Shutdown(ctx)
}

// asynqOverrides are the routing decisions the scenario's asynq middleware
// overrode (caughtup.asynq.overrides), by kind, and their total.
func (r *run) asynqOverrides() (map[string]int64, int64) {
	by := r.metrics.sum("caughtup.asynq.overrides", "caughtup.asynq.override")
	var total int64
	for _, n := range by {
		total += n
	}
	return by, total
}
