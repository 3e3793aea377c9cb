package caughtuphttp

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// ScopeName is the instrumentation scope of the instruments this package
// creates. Routing decisions themselves are counted by the consume
// package (caughtup.consume.decisions, source "http <route>").
const ScopeName = "github.com/caughtup/caughtup/web/caughtuphttp"

const (
	attrReason = "caughtup.reason"
	attrResult = "caughtup.result"
)

// result is what a request whose value was rejected read instead, the
// caughtup.result of caughtup.http.tokens.rejected.
type result uint8

const (
	// resultPrimary: the primary, charged to the router's fallback cap.
	resultPrimary result = iota
	// resultSessionLess: the cap was spent; read as a request without the
	// value (any caught-up replica).
	resultSessionLess

	numResults = 2
)

func resultOf(capped bool) result {
	if capped {
		return resultSessionLess
	}
	return resultPrimary
}

func (r result) String() string {
	if r == resultSessionLess {
		return "session_less"
	}
	return "primary"
}

// metrics are synchronous instruments whose attribute sets are built once,
// so that two middlewares on one MeterProvider add to the same series.
type metrics struct {
	rejected    metric.Int64Counter
	rejectedSet [numResults][numReasons]metric.AddOption
	issued      metric.Int64Counter
	late        metric.Int64Counter
	unavailable metric.Int64Counter
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	meter := mp.Meter(ScopeName)
	m := &metrics{}
	var err error
	if m.rejected, err = meter.Int64Counter("caughtup.http.tokens.rejected",
		metric.WithUnit("{request}"),
		metric.WithDescription("Requests whose session value (cookie or header), or an entry of it, was ignored, by caughtup.reason and by caughtup.result: primary (read the primary, charged to the router's fallback cap) or session_less (the cap was spent: read as a request without the value).")); err != nil {
		return nil, fmt.Errorf("caughtup/http: creating caughtup.http.tokens.rejected: %w", err)
	}
	for res := range result(numResults) {
		for r := Reason(1); int(r) < numReasons; r++ {
			m.rejectedSet[res][r] = metric.WithAttributeSet(attribute.NewSet(
				attribute.String(attrReason, r.String()), attribute.String(attrResult, res.String())))
		}
	}
	if m.issued, err = meter.Int64Counter("caughtup.http.tokens.issued",
		metric.WithUnit("{response}"),
		metric.WithDescription("Responses that gave the client a new session value: the request wrote, or its value lost a foreign entry.")); err != nil {
		return nil, fmt.Errorf("caughtup/http: creating caughtup.http.tokens.issued: %w", err)
	}
	if m.late, err = meter.Int64Counter("caughtup.http.tokens.late",
		metric.WithUnit("{response}"),
		metric.WithDescription("Responses whose handler wrote after the response header was sent (or the connection was hijacked): the client did not get those writes' token, and its next request may read a replica without them. Write before responding.")); err != nil {
		return nil, fmt.Errorf("caughtup/http: creating caughtup.http.tokens.late: %w", err)
	}
	if m.unavailable, err = meter.Int64Counter("caughtup.http.requests.unavailable",
		metric.WithUnit("{request}"),
		metric.WithDescription("Requests answered unavailable: no replica had replayed their session's token and the fallback cap kept them off the primary for MaxWait.")); err != nil {
		return nil, fmt.Errorf("caughtup/http: creating caughtup.http.requests.unavailable: %w", err)
	}
	return m, nil
}

func (m *metrics) reject(ctx context.Context, r Reason, res result) {
	if r > 0 && int(r) < numReasons && res < numResults {
		m.rejected.Add(ctx, 1, m.rejectedSet[res][r])
	}
}
