package kafka

import (
	"context"
	"fmt"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/caughtup/caughtup/consume"
)

// Result names what a consumer did with a record: the values of the
// caughtup.kafka.result attribute on the caughtup.kafka.messages counter.
type Result uint8

const (
	// Handled: the handler returned nil; the offset will be committed.
	Handled Result = iota
	// Waited: InPlace mode waits for a replica and routes the record
	// again (counted per deferral).
	Waited
	// Deferred: RetryTopic mode republished a deferred record to the
	// retry topic.
	Deferred
	// Retried: the handler failed and will run the record again (counted
	// per failed attempt before the last).
	Retried
	// DeadLettered: the handler failed MaxAttempts times and the record
	// went to the dead-letter topic or hook.
	DeadLettered
	// Dropped: the consumer stopped or lost the partition before the
	// record was done; it is not committed and will be delivered again.
	Dropped
	// Woken: a deferral for lag ended early because a replica had
	// replayed the record's token: RetryTopic mode stopped waiting for the
	// record's due time, or InPlace mode stopped holding a deferral that
	// Route made without waiting (the cap, waiting disabled, no healthy
	// replica). The record is then routed again and counted again.
	Woken

	numResults
)

var resultNames = [numResults]string{"handled", "waited", "deferred", "retried", "dead_lettered", "dropped", "woken"}

// String returns the attribute value: "handled", "waited", "deferred",
// "retried", "dead_lettered", "dropped" or "woken".
func (r Result) String() string {
	if r < numResults {
		return resultNames[r]
	}
	return fmt.Sprintf("result(%d)", uint8(r))
}

// AttrResult is the counter's result attribute.
const AttrResult = "caughtup.kafka.result"

// Topic records the results of one topic's records: one Add with a
// prebuilt attribute set.
type Topic struct {
	messages metric.Int64Counter
	opts     [numResults]metric.AddOption
}

// NewTopics creates the caughtup.kafka.messages counter on mp under scope
// and the attribute sets of topics. It is a synchronous counter: its sums
// outlive the consumer, and consumers made one after the other on one
// MeterProvider add to the same series.
func NewTopics(mp metric.MeterProvider, scope string, topics []string) (map[string]*Topic, error) {
	messages, err := mp.Meter(scope).Int64Counter("caughtup.kafka.messages",
		metric.WithUnit("{message}"),
		metric.WithDescription("What the consumer did with each message, by topic and result (handled, waited, deferred, retried, dead_lettered, dropped, woken)."))
	if err != nil {
		return nil, err
	}
	m := make(map[string]*Topic, len(topics))
	for _, name := range topics {
		tm := &Topic{messages: messages}
		for r := range numResults {
			tm.opts[r] = metric.WithAttributeSet(attribute.NewSet(
				semconv.MessagingSystemKafka,
				semconv.MessagingDestinationName(name),
				attribute.String(AttrResult, r.String()),
			))
		}
		m[name] = tm
	}
	return m, nil
}

// Counts is what one partition's worker counted since the last flush: its
// results, and the router's decisions in a consume.Tally. At hundreds of
// thousands of records a second, three counter Adds a record would cost
// more than the rest of the consumer's work on it, so the committer adds
// them to the instruments at every commit and when the partition stops.
type Counts struct {
	Topic   *Topic
	Tally   *consume.Tally
	results [numResults]atomic.Int64
}

// Add counts one record's result until the next Flush.
func (c *Counts) Add(r Result) { c.results[r].Add(1) }

// Flush adds the counts since the last Flush to the instruments. ctx's
// values (not its cancellation) go to the instruments.
func (c *Counts) Flush(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	for r := range numResults {
		if n := c.results[r].Swap(0); n > 0 {
			c.Topic.messages.Add(ctx, n, c.Topic.opts[r])
		}
	}
	c.Tally.Flush(ctx)
}
