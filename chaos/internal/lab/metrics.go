package lab

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
	if attr == "" {
		return m.sumBy(name)
	}
	return m.sumBy(name, attr)
}

// sumBy returns an Int64 counter's value per combination of the values of
// attrs, joined by "/" (all data points under "" without attrs).
func (m *runMetrics) sumBy(name string, attrs ...string) map[string]int64 {
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
				for i, attr := range attrs {
					v, _ := dp.Attributes.Value(attribute.Key(attr))
					if i > 0 {
						key += "/"
					}
					key += v.Emit()
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

// noteWakes notes what woke deferred jobs: the asynq middleware's wake
// (caughtup.asynq.wake.*) and the Kafka consumers' results by topic
// (caughtup.kafka.messages: woken is a retry-topic message run at its
// catch-up rather than its due time).
func (r *run) noteWakes() {
	woken := r.metrics.sumBy("caughtup.asynq.wake.tasks")[""]
	errs := r.metrics.sumBy("caughtup.asynq.wake.errors", "error.type")
	dropped := r.metrics.sumBy("caughtup.asynq.wake.dropped", "caughtup.asynq.wake.reason")
	if woken > 0 || len(errs) > 0 || len(dropped) > 0 {
		r.note("asynq wake: %d deferred tasks moved to pending at their catch-up; attempts that moved none, by error.type: %v; forgotten first: %v",
			woken, errs, dropped)
	}
	if res := r.metrics.sumBy("caughtup.kafka.messages", "messaging.destination.name", "caughtup.kafka.result"); len(res) > 0 {
		r.note("kafka results by topic/result: %v", res)
	}
}
