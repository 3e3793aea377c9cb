package examplesvc

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/caughtup/caughtup/consume"
)

// Where says where a handler's reads of database db went, from the
// decision caughtup attached to ctx: the outcome, and "@replica" when a
// replica was chosen (e.g. "replica_waited@replica1", "primary").
func Where(ctx context.Context, db string) string {
	dec, _ := consume.DecisionFrom(ctx)
	where := dec.Outcome.String()
	if dd, ok := dec.Database(db); ok && dd.Replica != "" {
		where += "@" + dd.Replica
	}
	return where
}

// Counts formats counts as "key=n" pairs in key order, space-separated,
// so that two runs with the same counts print the same line.
func Counts[N int | int64](counts map[string]N) string {
	parts := make([]string, 0, len(counts))
	for k, n := range counts {
		parts = append(parts, fmt.Sprintf("%s=%d", k, n))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

// CounterSums collects r and adds up the data points of the int64 counter
// name by the value of its attribute attr, formatted by Counts. Counters
// keep their sums after the instrumented object stops, so this reads what
// a consumer did once its Run has returned.
func CounterSums(ctx context.Context, r *sdkmetric.ManualReader, name, attr string) (string, error) {
	var rm metricdata.ResourceMetrics
	if err := r.Collect(ctx, &rm); err != nil {
		return "", err
	}
	by := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			sum, ok := m.Data.(metricdata.Sum[int64])
			if m.Name != name || !ok {
				continue
			}
			for _, dp := range sum.DataPoints {
				v, _ := dp.Attributes.Value(attribute.Key(attr))
				by[v.AsString()] += dp.Value
			}
		}
	}
	return Counts(by), nil
}
