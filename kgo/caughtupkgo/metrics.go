package caughtupkgo

import (
	"context"
	"fmt"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/caughtup/caughtup/consume"
)

// ScopeName is the instrumentation scope of every instrument this package
// creates.
const ScopeName = "github.com/caughtup/caughtup/kgo/caughtupkgo"

// result names what the Consumer did with a record: the values of the
// caughtup.kafka.result attribute on the caughtup.kafka.messages counter,
// the same instrument, attributes and values as caughtupkafka's, so that
// one dashboard and one alert cover both Kafka adapters.
type result uint8

const (
	// resultHandled: the handler returned nil; the offset will be committed.
	resultHandled result = iota
	// resultWaited: InPlace mode holds the record (its partition paused)
	// and routes it again, counted per deferral.
	resultWaited
	// resultDeferred: RetryTopic mode produced a deferred record to the
	// retry topic.
	resultDeferred
	// resultRetried: the handler failed and will run the record again.
	resultRetried
	// resultDeadLettered: the handler failed MaxAttempts times and the
	// record went to the dead-letter topic or hook.
	resultDeadLettered
	// resultDropped: the consumer stopped or lost the partition before the
	// record was done; it is not committed and will be delivered again.
	resultDropped
	// resultWoken: a deferral for lag ended early because a replica had
	// replayed the record's token.
	resultWoken

	numResults
)

var resultNames = [numResults]string{"handled", "waited", "deferred", "retried", "dead_lettered", "dropped", "woken"}

func (r result) String() string {
	if r < numResults {
		return resultNames[r]
	}
	return fmt.Sprintf("result(%d)", uint8(r))
}

const attrResult = "caughtup.kafka.result"

// topicMetrics records the results of one topic's records: one Add with a
// prebuilt attribute set.
type topicMetrics struct {
	messages metric.Int64Counter
	opts     [numResults]metric.AddOption
}

// newMetrics creates the counter on mp and the attribute sets of topics.
func newMetrics(mp metric.MeterProvider, topics []string) (map[string]*topicMetrics, error) {
	messages, err := mp.Meter(ScopeName).Int64Counter("caughtup.kafka.messages",
		metric.WithUnit("{message}"),
		metric.WithDescription("What the consumer did with each message, by topic and result (handled, waited, deferred, retried, dead_lettered, dropped, woken)."))
	if err != nil {
		return nil, err
	}
	m := make(map[string]*topicMetrics, len(topics))
	for _, name := range topics {
		tm := &topicMetrics{messages: messages}
		for r := range numResults {
			tm.opts[r] = metric.WithAttributeSet(attribute.NewSet(
				semconv.MessagingSystemKafka,
				semconv.MessagingDestinationName(name),
				attribute.String(attrResult, r.String()),
			))
		}
		m[name] = tm
	}
	return m, nil
}

// counts is what one partition's worker counted since the last flush: its
// results, and the router's decisions in a consume.Tally. At hundreds of
// thousands of records a second, three counter Adds a record would cost
// more than the rest of the consumer's work on it, so the committer adds
// them to the instruments at every commit and when the partition stops.
type counts struct {
	tm      *topicMetrics
	results [numResults]atomic.Int64
	tally   *consume.Tally
}

func (ps *counts) add(r result) { ps.results[r].Add(1) }

// flush adds the counts since the last flush to the instruments.
func (ps *counts) flush(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	for r := range numResults {
		if n := ps.results[r].Swap(0); n > 0 {
			ps.tm.messages.Add(ctx, n, ps.tm.opts[r])
		}
	}
	ps.tally.Flush(ctx)
}
