package caughtupkafka

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// ScopeName is the instrumentation scope of every instrument and span this
// package creates.
const ScopeName = "github.com/caughtup/caughtup/kafka/caughtupkafka"

// result names what the Consumer did with a message: the values of the
// caughtup.kafka.result attribute (result.String) on the
// caughtup.kafka.messages counter, which also carries messaging.system
// "kafka" and messaging.destination.name (the topic the message was read
// from).
type result uint8

const (
	// resultHandled: the handler returned nil; the offset will be committed.
	resultHandled result = iota
	// resultWaited: InPlace mode waits for a replica and routes the
	// message again (counted per deferral).
	resultWaited
	// resultDeferred: RetryTopic mode republished a deferred message to
	// the retry topic.
	resultDeferred
	// resultRetried: the handler failed and will run the message again
	// (counted per failed attempt before the last).
	resultRetried
	// resultDeadLettered: the handler failed MaxAttempts times and the
	// message went to the dead-letter topic or hook.
	resultDeadLettered
	// resultDropped: the consumer stopped or lost the partition before the
	// message was done; it is not committed and will be delivered again.
	resultDropped
	// resultWoken: a deferral for lag ended early because a replica had
	// replayed the message's token: RetryTopic mode stopped waiting for
	// the message's due time, or InPlace mode stopped holding a deferral
	// that Route made without waiting (the cap, waiting disabled, no
	// healthy replica). The message is then routed again and counted again
	// (handled, …).
	resultWoken

	numResults
)

var resultNames = [numResults]string{"handled", "waited", "deferred", "retried", "dead_lettered", "dropped", "woken"}

// String returns the attribute value: "handled", "waited", "deferred",
// "retried", "dead_lettered", "dropped" or "woken".
func (r result) String() string {
	if r < numResults {
		return resultNames[r]
	}
	return fmt.Sprintf("result(%d)", uint8(r))
}

const attrResult = "caughtup.kafka.result"

// metrics holds the consumer's synchronous counter and, per consumed topic
// and result, its attribute set, built once: a message costs one Add with
// a prebuilt option. The SDK keeps the sums, so the counts outlive Run and
// the Consumer, and consumers made one after the other on one
// MeterProvider add to the same series.
type metrics struct {
	topics map[string]*topicMetrics
}

// topicMetrics records the results of one topic's messages.
type topicMetrics struct {
	messages metric.Int64Counter
	opts     [numResults]metric.AddOption
}

func (tm *topicMetrics) add(ctx context.Context, r result) { tm.messages.Add(ctx, 1, tm.opts[r]) }

// newMetrics creates the counter on mp and the attribute sets of topics.
func newMetrics(mp metric.MeterProvider, topics []string) (*metrics, error) {
	messages, err := mp.Meter(ScopeName).Int64Counter("caughtup.kafka.messages",
		metric.WithUnit("{message}"),
		metric.WithDescription("What the consumer did with each message, by topic and result (handled, waited, deferred, retried, dead_lettered, dropped, woken)."))
	if err != nil {
		return nil, err
	}
	m := &metrics{topics: make(map[string]*topicMetrics, len(topics))}
	for _, name := range topics {
		tm := &topicMetrics{messages: messages}
		for r := range numResults {
			tm.opts[r] = metric.WithAttributeSet(attribute.NewSet(
				semconv.MessagingSystemKafka,
				semconv.MessagingDestinationName(name),
				attribute.String(attrResult, r.String()),
			))
		}
		m.topics[name] = tm
	}
	return m, nil
}

// topic returns the recorder of one consumed topic. The map is complete
// from newMetrics on and never written again.
func (m *metrics) topic(name string) *topicMetrics { return m.topics[name] }
