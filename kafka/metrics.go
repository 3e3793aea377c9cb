package kafka

import (
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
)

// result names what the Engine did with a record: the values of the
// caughtup.kafka.result attribute on the caughtup.kafka.messages counter.
type result uint8

const (
	// resultHandled: the handler returned nil; the offset will be committed.
	resultHandled result = iota
	// resultWaited: InPlace mode waits for a replica and routes the record
	// again (counted per deferral).
	resultWaited
	// resultDeferred: RetryTopic mode republished a deferred record to the
	// retry topic.
	resultDeferred
	// resultRetried: the handler failed and will run the record again (counted
	// per failed attempt before the last).
	resultRetried
	// resultDeadLettered: the handler failed MaxAttempts times and the record
	// went to the dead-letter topic or hook.
	resultDeadLettered
	// resultDropped: the consumer stopped or lost the partition before the
	// record was done; it is not committed and will be delivered again.
	resultDropped
	// resultWoken: a deferral for lag ended early because a replica had
	// replayed the record's token: RetryTopic mode stopped waiting for the
	// record's due time, or InPlace mode stopped holding a deferral that
	// Route made without waiting (the cap, waiting disabled, no healthy
	// replica). The record is then routed again and counted again.
	resultWoken
	// resultRerouted: the handler failed because a replica the router
	// chose failed it (consume.ReplicaFailed): the record read nothing and
	// is routed again without spending an attempt.
	resultRerouted

	numResults
)

var resultNames = [numResults]string{"handled", "waited", "deferred", "retried", "dead_lettered", "dropped", "woken", "rerouted"}

// String returns the attribute value.
func (r result) String() string {
	if r < numResults {
		return resultNames[r]
	}
	return fmt.Sprintf("result(%d)", uint8(r))
}

// attrResult is the counter's result attribute.
const attrResult = "caughtup.kafka.result"

// topicCounter records the results of one topic's records: one Add with a
// prebuilt attribute set.
type topicCounter struct {
	messages metric.Int64Counter
	opts     [numResults]metric.AddOption
}

// newTopics creates the caughtup.kafka.messages counter on mp under scope
// and the attribute sets of topics. It is a synchronous counter: its sums
// outlive the consumer, and consumers made one after the other on one
// MeterProvider add to the same series.
func newTopics(mp metric.MeterProvider, scope string, topics []string) (map[string]*topicCounter, error) {
	messages, err := mp.Meter(scope).Int64Counter("caughtup.kafka.messages",
		metric.WithUnit("{message}"),
		metric.WithDescription("What the consumer did with each message, by topic and result ("+resultList()+")."))
	if err != nil {
		return nil, err
	}
	m := make(map[string]*topicCounter, len(topics))
	for _, name := range topics {
		tc := &topicCounter{messages: messages}
		for r := range numResults {
			tc.opts[r] = metric.WithAttributeSet(attribute.NewSet(
				semconv.MessagingSystemKafka,
				semconv.MessagingDestinationName(name),
				attribute.String(attrResult, r.String()),
			))
		}
		m[name] = tc
	}
	return m, nil
}

// resultList is the results' names, comma-separated.
func resultList() string {
	s := ""
	for r := range numResults {
		if r > 0 {
			s += ", "
		}
		s += r.String()
	}
	return s
}
