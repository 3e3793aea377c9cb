package replay

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// Attribute names of the feed's and the fallback budget's instruments.
const (
	attrFeedDirection = "caughtup.feed.direction"
	attrFeedState     = "caughtup.feed.state"
	attrBudget        = "caughtup.budget"
)

// feedMetrics are a Router's feed instruments: synchronous counters (their
// sums outlive Close) and two gauges registered while the Router runs.
type feedMetrics struct {
	switches metric.Int64Counter
	rejected metric.Int64Counter
	reg      metric.Registration

	toFeed     [numFeedStates]metric.MeasurementOption
	toLocal    [numFeedStates]metric.MeasurementOption
	rejectedBy [numFeedRejects]metric.MeasurementOption
	all        metric.MeasurementOption
}

// feedAttrs is db.system.name, the feed's channel, and kv.
func feedAttrs(channel string, kv ...attribute.KeyValue) metric.MeasurementOption {
	return metric.WithAttributeSet(attribute.NewSet(append([]attribute.KeyValue{
		semconv.DBSystemNamePostgreSQL, semconv.MessagingDestinationName(channel)}, kv...)...))
}

func newFeedMetrics(mp metric.MeterProvider, f *feedState) (*feedMetrics, error) {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	m := &feedMetrics{all: feedAttrs(f.channel)}
	for i := range numFeedStates {
		st := attribute.String(attrFeedState, FeedState(i).String())
		m.toFeed[i] = feedAttrs(f.channel, attribute.String(attrFeedDirection, "to_feed"), st)
		m.toLocal[i] = feedAttrs(f.channel, attribute.String(attrFeedDirection, "to_local"), st)
	}
	for i := range m.rejectedBy {
		m.rejectedBy[i] = feedAttrs(f.channel, attribute.String(attrReason, feedReject(i).String()))
	}
	var err error
	if m.switches, err = meter.Int64Counter("caughtup.consume.feed.switches",
		metric.WithUnit("{switch}"),
		metric.WithDescription("Switches of a Router between the position feed and polling every node itself, by direction (to_feed, to_local) and the subscriber state that caused it (subscribed; silent, unreachable, dropped).")); err != nil {
		return nil, err
	}
	if m.rejected, err = meter.Int64Counter("caughtup.consume.feed.observations.rejected",
		metric.WithUnit("{observation}"),
		metric.WithDescription("Authentic feed observations the Router did not believe, by reason (delayed, unknown_node, unconfirmed, mismatch, no_incarnation, superseded, unverified); messages the feed package rejects are caughtup.feed.rejected.")); err != nil {
		return nil, err
	}
	active, err := meter.Int64ObservableGauge("caughtup.consume.feed.active",
		metric.WithUnit("1"),
		metric.WithDescription("1 while the Router takes positions from the feed, 0 while it polls every node itself."))
	if err != nil {
		return nil, err
	}
	local, err := meter.Int64ObservableGauge("caughtup.consume.feed.nodes.local",
		metric.WithUnit("{node}"),
		metric.WithDescription("Nodes the Router polls itself: all while the feed is not active, else those the feed does not cover."))
	if err != nil {
		return nil, err
	}
	m.reg, err = meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		s := f.status()
		v := int64(0)
		if s.Active {
			v = 1
		}
		o.ObserveInt64(active, v, m.all)
		o.ObserveInt64(local, int64(s.LocalNodes), m.all)
		return nil
	}, active, local)
	if err != nil {
		return nil, err
	}
	return m, nil
}

func (m *feedMetrics) close() {
	if m.reg != nil {
		_ = m.reg.Unregister()
	}
}

func (m *feedMetrics) switched(toFeed bool, st FeedState) {
	if st >= numFeedStates {
		return
	}
	opt := m.toLocal[st]
	if toFeed {
		opt = m.toFeed[st]
	}
	m.switches.Add(context.Background(), 1, opt)
}

func (m *feedMetrics) reject(r feedReject) {
	m.rejected.Add(context.Background(), 1, m.rejectedBy[r])
}
