package caughtupkafka_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// retryRun is one handler run as the wake tests see it.
type retryRun struct {
	topic   string
	dec     consume.Decision
	due     time.Time
	at      time.Time
	found   bool
	attempt int
}

// retryRecorder is a handler that reads the message's row (id 1) where
// the router sent it and reports the run; fail makes attempts fail.
func retryRecorder(runs chan<- retryRun, fail func(attempt int) error) caughtupkafka.Handler {
	return func(ctx context.Context, msg kafka.Message) error {
		r := retryRun{topic: msg.Topic, at: time.Now(), attempt: caughtupkafka.Attempt(ctx)}
		if ms, err := strconv.ParseInt(header(msg, caughtupkafka.HeaderDue), 10, 64); err == nil {
			r.due = time.UnixMilli(ms)
		}
		if fail != nil {
			if err := fail(r.attempt); err != nil {
				return err
			}
		}
		r.dec, _ = consume.DecisionFrom(ctx)
		var n int
		if err := consume.DB(ctx, "main").QueryRow(ctx, `SELECT count(*) FROM items WHERE id = 1`).Scan(&n); err != nil {
			return err
		}
		r.found = n == 1
		runs <- r
		return nil
	}
}

// resumeAndRun resumes replay on every replica and returns the deferred
// message's run and the time from the resume to it. The run must come
// within 30s: half the tests' one-minute deferral, so only a wake runs it
// in time.
func resumeAndRun(t *testing.T, e *env, runs <-chan retryRun) (retryRun, time.Duration) {
	t.Helper()
	resumed := time.Now()
	e.ResumeAll(t)
	select {
	case r := <-runs:
		return r, r.at.Sub(resumed)
	case <-time.After(30 * time.Second):
		t.Fatal("the deferred message did not run within 30s of the resume; its deferral is a minute")
		return retryRun{}, 0
	}
}

// TestRetryTopicWakesOnCatchUp: a message deferred to the retry topic
// while every replica is paused, with a deferral of a minute, runs from
// the retry topic soon after replay resumes: well before its due time,
// which only the wake explains, on a replica that has its row, without a
// failed attempt.
func TestRetryTopicWakesOnCatchUp(t *testing.T) {
	e := setupDB(t, func(c *consume.Config) {
		c.WaitBudget = 100 * time.Millisecond
		c.DeferInitial = time.Minute
		c.DeferMax = time.Minute
		c.MaxAge = 10 * time.Minute
	})
	names := kafkasuite.NewTopics(t, 1, "", ".retry", ".dlt")
	republisher := fault.NewWriter(newRepublisher(t))
	republished := make(chan struct{}, 16)
	republisher.AfterWrite(func(_ context.Context, msgs []kafka.Message) {
		for _, m := range msgs {
			if m.Topic == names[1] {
				republished <- struct{}{}
			}
		}
	})
	runs := make(chan retryRun, 16)
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: names[0], Mode: caughtupkafka.RetryTopic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
		Writer: republisher,
	}, retryRecorder(runs, nil))
	w := caughtupkafka.NewWriter(newWriter(t, names[0]))

	e.PauseAll(t)
	ctx, err := e.Insert(t.Context(), 1, "k", 0)
	require.NoError(t, err)
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("stamped")}))
	wait(t, republished, "the deferral to the retry topic")
	require.Empty(t, runs, "the message ran while every replica was paused")

	r, latency := resumeAndRun(t, e, runs)
	require.Equal(t, names[1], r.topic, "the deferred message runs from the retry topic")
	require.True(t, r.found, "the message did not find its row")
	require.NotEmpty(t, func() string { dd, _ := r.dec.Database("main"); return dd.Replica }(), "outcome %s", r.dec.Outcome)
	require.True(t, r.at.Before(r.due), "ran at %v, not before its due time %v", r.at, r.due)
	require.Zero(t, r.attempt, "a deferral counted as a failed attempt")
	// Counts reach the MeterProvider at the next offset commit.
	require.Eventually(t, func() bool { return e.Results(t)["woken"] == 1 }, 30*time.Second, 10*time.Millisecond, "results %v", e.Results(t))
	require.Equal(t, int64(1), e.Results(t)["deferred"], "deferred once, not again from the retry topic")
	t.Logf("resume → handler start %v (%v before its due time)", latency, r.due.Sub(r.at))
}

// TestRetryTopicHandlerErrorWaitsOutItsBackoff: a message republished
// after a handler error is not a deferral: its token is caught up, yet it
// runs again only at its due time.
func TestRetryTopicHandlerErrorWaitsOutItsBackoff(t *testing.T) {
	e := setupDB(t, kafkasuite.FastRouter)
	names := kafkasuite.NewTopics(t, 1, "", ".retry", ".dlt")
	runs := make(chan retryRun, 16)
	boom := errors.New("boom")
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: names[0], Mode: caughtupkafka.RetryTopic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
		RetryBackoffInitial: time.Second, RetryBackoffMax: time.Second,
	}, retryRecorder(runs, func(attempt int) error {
		if attempt == 0 {
			return boom
		}
		return nil
	}))
	w := caughtupkafka.NewWriter(newWriter(t, names[0]))
	ctx, err := e.Insert(t.Context(), 1, "k", 0)
	require.NoError(t, err)
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("stamped")}))

	r := wait(t, runs, "the retry after the handler error")
	require.Equal(t, names[1], r.topic)
	require.Equal(t, 1, r.attempt)
	require.True(t, r.found)
	require.False(t, r.at.Before(r.due), "ran at %v, before its due time %v", r.at, r.due)
	require.Zero(t, e.Results(t)["woken"], "a retry after a handler error was woken")
	require.Equal(t, int64(1), e.Results(t)["retried"])
}

// TestInPlaceDeferralWakesOnCatchUp: with waiting disabled, Route defers
// at once and the partition holds the message in place for the deferral,
// a minute here; it runs soon after replay resumes, on a replica that has
// its row, because the hold ends when a replica passes the token.
func TestInPlaceDeferralWakesOnCatchUp(t *testing.T) {
	e := setupDB(t, func(c *consume.Config) {
		c.WaitBudget = -1
		c.DeferInitial = time.Minute
		c.DeferMax = time.Minute
		c.MaxAge = 10 * time.Minute
	})
	topic := kafkasuite.NewTopics(t, 1, "")[0]
	runs := make(chan retryRun, 16)
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: topic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
	}, retryRecorder(runs, nil))
	w := caughtupkafka.NewWriter(newWriter(t, topic))

	e.PauseAll(t)
	ctx, err := e.Insert(t.Context(), 1, "k", 0)
	require.NoError(t, err)
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("stamped")}))
	// Counts reach the MeterProvider at the next offset commit.
	require.Eventually(t, func() bool { return e.Results(t)["waited"] >= 1 }, 30*time.Second, 10*time.Millisecond,
		"the message was never deferred: results %v", e.Results(t))
	require.Empty(t, runs, "the message ran while every replica was paused")

	r, latency := resumeAndRun(t, e, runs)
	require.Equal(t, topic, r.topic)
	require.True(t, r.found, "the message did not find its row")
	require.NotEmpty(t, func() string { dd, _ := r.dec.Database("main"); return dd.Replica }(), "outcome %s", r.dec.Outcome)
	require.Zero(t, r.attempt, "a deferral counted as a failed attempt")
	require.Eventually(t, func() bool { return e.Results(t)["woken"] == 1 }, 30*time.Second, 10*time.Millisecond, "results %v", e.Results(t))
	require.Equal(t, int64(1), e.Results(t)["waited"], "held once")
	t.Logf("resume → handler start %v", latency)
}
