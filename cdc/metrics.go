package cdc

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of every instrument this package
// creates.
const ScopeName = "github.com/caughtup/caughtup/cdc"

// Attribute names on metrics, besides db.system.name.
const (
	attrStatus = "caughtup.cdc.status"
	attrReason = "caughtup.reason"
)

const numStatuses = int(StatusFresh) + 1

// metrics counts checks with synchronous counters. Every attribute set is
// built once, here: status and reason are small closed enums.
type metrics struct {
	checks  metric.Int64Counter
	primary metric.Int64Counter

	checkSets   [numStatuses][numReasons]metric.AddOption
	primarySets [numReasons]metric.AddOption
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	meter := mp.Meter(ScopeName)
	m := &metrics{}
	var err error
	if m.checks, err = meter.Int64Counter("caughtup.cdc.checks",
		metric.WithUnit("{check}"),
		metric.WithDescription("Freshness checks of CDC events against a replica, by status (fresh, not_yet, unknown) and reason.")); err != nil {
		return nil, err
	}
	if m.primary, err = meter.Int64Counter("caughtup.cdc.primary",
		metric.WithUnit("{event}"),
		metric.WithDescription("CDC events for which no commit-safe rule applies or the replica could not answer (malformed envelope, missing lsn or txId, not PostgreSQL, snapshot read, replica error, …): they must read the primary.")); err != nil {
		return nil, err
	}
	for s := range numStatuses {
		for r := range numReasons {
			m.checkSets[s][r] = metric.WithAttributeSet(attribute.NewSet(semconv.DBSystemNamePostgreSQL,
				attribute.String(attrStatus, Status(s).String()), attribute.String(attrReason, Reason(r).String())))
		}
	}
	for r := range numReasons {
		m.primarySets[r] = metric.WithAttributeSet(attribute.NewSet(semconv.DBSystemNamePostgreSQL,
			attribute.String(attrReason, Reason(r).String())))
	}
	return m, nil
}

func (m *metrics) record(ctx context.Context, r Result) {
	if int(r.Status) >= numStatuses || int(r.Reason) >= numReasons {
		return // not produced by this package
	}
	ctx = context.WithoutCancel(ctx)
	m.checks.Add(ctx, 1, m.checkSets[r.Status][r.Reason])
	if r.Status == StatusUnknown {
		m.primary.Add(ctx, 1, m.primarySets[r.Reason])
	}
}
