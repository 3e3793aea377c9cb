package kafka

import (
	"context"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of every instrument this package
// creates.
const ScopeName = "github.com/caughtup/caughtup/kafka"

// Result names what the Consumer did with a message: the values of the
// caughtup.kafka.result attribute on the caughtup.kafka.messages counter,
// which also carries messaging.system "kafka" and
// messaging.destination.name (the topic the message was read from).
type Result string

const (
	// ResultHandled: the handler returned nil; the offset will be committed.
	ResultHandled Result = "handled"
	// ResultWaited: InPlace mode slept a deferral's delay and routes the
	// message again (counted per deferral).
	ResultWaited Result = "waited"
	// ResultDeferred: RetryTopic mode republished a deferred message to
	// the retry topic.
	ResultDeferred Result = "deferred"
	// ResultRetried: the handler failed and will run the message again
	// (counted per failed attempt before the last).
	ResultRetried Result = "retried"
	// ResultDeadLettered: the handler failed MaxAttempts times and the
	// message went to the dead-letter topic or hook.
	ResultDeadLettered Result = "dead_lettered"
	// ResultDropped: the consumer stopped or lost the partition before the
	// message was done; it is not committed and will be delivered again.
	ResultDropped Result = "dropped"
)

const attrResult = "caughtup.kafka.result"

// result indexes a topic's counters.
type result uint8

const (
	handled result = iota
	waited
	deferred
	retried
	deadLettered
	dropped
	numResults
)

var resultNames = [numResults]Result{ResultHandled, ResultWaited, ResultDeferred, ResultRetried, ResultDeadLettered, ResultDropped}

// metrics counts in atomics on the message path and reports them through
// an observable counter: a message costs one atomic add, not an SDK call
// with attribute handling.
type metrics struct {
	counter metric.Int64ObservableCounter
	meter   metric.Meter

	mu     sync.Mutex
	topics map[string]*topicCounts
}

type topicCounts struct {
	n    [numResults]atomic.Int64
	opts [numResults]metric.ObserveOption
}

func (tc *topicCounts) add(r result) { tc.n[r].Add(1) }

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	m := &metrics{meter: mp.Meter(ScopeName), topics: map[string]*topicCounts{}}
	var err error
	m.counter, err = m.meter.Int64ObservableCounter("caughtup.kafka.messages",
		metric.WithUnit("{message}"),
		metric.WithDescription("What the consumer did with each message, by topic and result (handled, waited, deferred, retried, dead_lettered, dropped)."))
	return m, err
}

// register reports the counters until the returned function is called.
func (m *metrics) register() (func(), error) {
	reg, err := m.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		m.mu.Lock()
		defer m.mu.Unlock()
		for _, tc := range m.topics {
			for r := range numResults {
				if n := tc.n[r].Load(); n > 0 {
					o.ObserveInt64(m.counter, n, tc.opts[r])
				}
			}
		}
		return nil
	}, m.counter)
	if err != nil {
		return nil, err
	}
	return func() { _ = reg.Unregister() }, nil
}

// topic returns the counters of one topic.
func (m *metrics) topic(name string) *topicCounts {
	m.mu.Lock()
	defer m.mu.Unlock()
	tc := m.topics[name]
	if tc == nil {
		tc = &topicCounts{}
		for r := range numResults {
			tc.opts[r] = metric.WithAttributeSet(attribute.NewSet(
				semconv.MessagingSystemKafka,
				semconv.MessagingDestinationName(name),
				attribute.String(attrResult, string(resultNames[r])),
			))
		}
		m.topics[name] = tc
	}
	return tc
}
