package replay

import (
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of every instrument this package
// creates. The instruments keep the names they had under consume
// (caughtup.consume.replica.lag, …), so dashboards need no change.
const ScopeName = "github.com/caughtup/caughtup/replay"

// Attribute names on metrics and log fields, besides db.system.name.
const (
	attrReason   = "caughtup.reason"
	attrDatabase = "caughtup.database"
	attrReplica  = "caughtup.replica"
)

// withSystem is the attribute set db.system.name plus kv, as the one
// option every kind of instrument takes.
func withSystem(kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(append([]attribute.KeyValue{semconv.DBSystemNamePostgreSQL}, kv...)...))
}
