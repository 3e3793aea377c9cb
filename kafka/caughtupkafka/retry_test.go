package caughtupkafka_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

func header(msg kafka.Message, key string) string {
	for i := len(msg.Headers) - 1; i >= 0; i-- {
		if msg.Headers[i].Key == key {
			return string(msg.Headers[i].Value)
		}
	}
	return ""
}

// TestRetryTopicRunsDeferredMessageWhenDue: with every replica paused, a
// stamped message is deferred to the retry topic (the partition moves on:
// a later message without a token runs at once on the primary); once
// replay resumes it runs from the retry topic, on a replica that has its
// row: at its due time, or before it if a replica caught up first (then
// counted as woken).
func TestRetryTopicRunsDeferredMessageWhenDue(t *testing.T) {
	e := setupDB(t, func(c *consume.Config) {
		c.WaitBudget = 100 * time.Millisecond
		c.DeferInitial = 300 * time.Millisecond
		c.DeferMax = time.Second
	})
	names := kafkasuite.NewTopics(t, 3, "", ".retry", ".dlt")
	type run struct {
		topic   string
		dec     consume.Decision
		due     string
		at      time.Time
		found   bool
		attempt int
	}
	runs := make(chan run, 16)
	// Every write to the retry topic is an event: the first is the
	// deferral of the original, the second that of the retry topic's copy,
	// routed again once due and still behind.
	republisher := fault.NewWriter(newRepublisher(t))
	republished := make(chan struct{}, 64)
	republisher.AfterWrite(func(_ context.Context, msgs []kafka.Message) {
		for _, m := range msgs {
			if m.Topic == names[1] {
				republished <- struct{}{}
			}
		}
	})
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: names[0], Mode: caughtupkafka.RetryTopic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
		Writer: republisher,
	}, func(ctx context.Context, msg kafka.Message) error {
		r := run{topic: msg.Topic, due: header(msg, caughtupkafka.HeaderDue), at: time.Now(), attempt: caughtupkafka.Attempt(ctx)}
		r.dec, _ = consume.DecisionFrom(ctx)
		if string(msg.Value) == "stamped" {
			var n int
			err := consume.DB(ctx, "main").QueryRow(ctx, `SELECT count(*) FROM items WHERE id = 1`).Scan(&n)
			if err != nil {
				return err
			}
			r.found = n == 1
		}
		runs <- r
		return nil
	})
	w := caughtupkafka.NewWriter(newWriter(t, names[0]))

	e.PauseAll(t)
	ctx, err := e.Insert(t.Context(), 1, "k", 0)
	require.NoError(t, err)
	require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("stamped")}))
	require.NoError(t, w.WriteMessages(t.Context(), kafka.Message{Key: []byte("k"), Value: []byte("unstamped")}))

	var first run
	select {
	case first = <-runs:
	case <-time.After(30 * time.Second):
		t.Fatal("the unstamped message behind the deferred one did not run")
	}
	require.Equal(t, names[0], first.topic)
	require.Equal(t, consume.OutcomePrimaryNoToken, first.dec.Outcome, "only the unstamped message can run while replay is paused")
	wait(t, republished, "the deferral of the stamped message")
	wait(t, republished, "the second deferral, from the retry topic")
	require.Empty(t, runs, "the stamped message ran while every replica was paused")
	// Counted at the next commit (CommitInterval).
	require.Eventually(t, func() bool { return e.Results(t)["deferred"] >= 2 }, 30*time.Second, 10*time.Millisecond)

	e.ResumeAll(t)
	var second run
	select {
	case second = <-runs:
	case <-time.After(30 * time.Second):
		t.Fatal("the deferred message did not run after replay resumed")
	}
	require.Equal(t, names[1], second.topic, "the deferred message runs from the retry topic")
	require.True(t, second.found, "the deferred message did not find its row")
	require.Contains(t, []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited}, second.dec.Outcome)
	due, err := strconv.ParseInt(second.due, 10, 64)
	require.NoError(t, err)
	if second.at.Before(time.UnixMilli(due)) {
		// Counts reach the MeterProvider at the next offset commit.
		require.Eventually(t, func() bool { return e.Results(t)["woken"] > 0 }, 30*time.Second, 10*time.Millisecond,
			"ran at %v, before its due time %v, without a catch-up", second.at, time.UnixMilli(due))
	}
	require.Zero(t, second.attempt, "a deferral counted as a failed attempt")
	t.Logf("results %v; outcomes %v", e.Results(t), e.Outcomes(t))
}

// TestRetryTopicCrashBetweenRepublishAndCommit: the consumer dies after a
// deferred message was written to the retry topic (the broker acknowledged
// it) and before the original's offset was committed. The original is
// delivered again to the next consumer in the group, the retry topic holds
// the copy: the message runs (at least once), nothing is lost.
func TestRetryTopicCrashBetweenRepublishAndCommit(t *testing.T) {
	t.Parallel()
	e := setupDB(t, kafkasuite.FastRouter)
	names := kafkasuite.NewTopics(t, 2, "", ".retry", ".dlt")
	group := kafkasuite.NewGroup(t)
	var warm atomic.Int64
	ran := make(chan kafka.Message, 16)
	h := func(ctx context.Context, msg kafka.Message) error {
		if string(msg.Value) == "warm-up" {
			warm.Add(1)
			return nil
		}
		ran <- msg
		return nil
	}
	cfg := killable(caughtupkafka.ConsumerConfig{Topic: names[0], GroupID: group, Mode: caughtupkafka.RetryTopic, Router: e.Router, Policy: consume.Delayed})

	// The first member dies right after its first republish was
	// acknowledged: before the consumer learns that the write succeeded,
	// so before the original can be marked done, let alone committed.
	republisher := fault.NewWriter(newRepublisher(t))
	first := cfg
	first.Writer = republisher
	firstRun := startConsumer(t, first, h)
	killed := make(chan struct{})
	var once sync.Once
	republisher.AfterWrite(func(context.Context, []kafka.Message) {
		once.Do(func() {
			firstRun.dialer.Refuse(true)
			firstRun.dialer.Cut()
			close(killed)
		})
	})
	w := caughtupkafka.NewWriter(newWriter(t, names[0]))
	require.NoError(t, w.WriteMessages(t.Context(), kafka.Message{Key: []byte("w"), Value: []byte("warm-up")}))
	require.Eventually(t, func() bool { return warm.Load() == 1 }, 30*time.Second, 10*time.Millisecond)
	require.NoError(t, w.WriteMessages(enqueue.WithToken(t.Context(), e.FarAhead(t)),
		kafka.Message{Key: []byte("k"), Value: []byte("deferred")}))
	wait(t, killed, "the republish of the deferred message")
	require.NoError(t, firstRun.Stop())
	select {
	case msg := <-ran:
		t.Fatalf("the deferred message ran before any replica had its token (from %s)", msg.Topic)
	default:
	}

	// The next member routes with Sticky, so that whatever it is given
	// runs at once (on the primary, as no replica will reach the token)
	// and shows where it came from.
	next := cfg
	next.Policy = consume.Sticky
	startConsumer(t, next, h)
	var fromMain, fromRetry int
	for fromMain == 0 || fromRetry == 0 {
		msg := wait(t, ran, "a run of the deferred message")
		switch msg.Topic {
		case names[0]:
			fromMain++
		case names[1]:
			fromRetry++
		}
		t.Logf("the deferred message ran from %s", msg.Topic)
	}
	require.Positive(t, fromMain, "the original was not delivered again after the crash")
	require.Positive(t, fromRetry, "the retry topic lost its copy")
}

// TestDeadLetterInPlace: a message whose handler always fails is tried
// MaxAttempts times with backoff, then written to the dead-letter topic
// with the error and its origin; the messages behind it then run, in
// order.
func TestDeadLetterInPlace(t *testing.T) {
	t.Parallel()
	e := setupDB(t, nil)
	names := kafkasuite.NewTopics(t, 2, "", ".dlt")
	var mu sync.Mutex
	var attempts []int
	var order []string
	startConsumer(t, caughtupkafka.ConsumerConfig{Topic: names[0], Router: e.Router, MaxAttempts: 3},
		func(ctx context.Context, msg kafka.Message) error {
			mu.Lock()
			defer mu.Unlock()
			if string(msg.Value) == "poison" {
				attempts = append(attempts, caughtupkafka.Attempt(ctx))
				return errors.New("poison pill")
			}
			order = append(order, string(msg.Value))
			return nil
		})
	dead := make(chan kafka.Message, 4)
	startConsumer(t, caughtupkafka.ConsumerConfig{Topic: names[1], Router: e.Router}, func(ctx context.Context, msg kafka.Message) error {
		dead <- msg
		return nil
	})
	w := newWriter(t, names[0])
	require.NoError(t, w.WriteMessages(t.Context(),
		kafka.Message{Key: []byte("k"), Value: []byte("poison")},
		kafka.Message{Key: []byte("k"), Value: []byte("a")},
		kafka.Message{Key: []byte("k"), Value: []byte("b")}))

	var msg kafka.Message
	select {
	case msg = <-dead:
	case <-time.After(30 * time.Second):
		t.Fatal("nothing reached the dead-letter topic")
	}
	require.Equal(t, "poison", string(msg.Value))
	require.Equal(t, "k", string(msg.Key))
	require.Equal(t, "poison pill", header(msg, caughtupkafka.HeaderError))
	require.Equal(t, "3", header(msg, caughtupkafka.HeaderAttempts))
	require.Equal(t, names[0], header(msg, caughtupkafka.HeaderOriginTopic))
	require.Equal(t, "0", header(msg, caughtupkafka.HeaderOriginOffset))
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == 2 }, 10*time.Second, 10*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int{0, 1, 2}, attempts)
	require.Equal(t, []string{"a", "b"}, order)
}

// TestDeadLetterHookRetryTopic: in RetryTopic mode failed attempts go
// through the retry topic (the partition does not wait for them), and the
// hook replaces the dead-letter topic.
func TestDeadLetterHookRetryTopic(t *testing.T) {
	t.Parallel()
	e := setupDB(t, nil)
	names := kafkasuite.NewTopics(t, 2, "", ".retry")
	var mu sync.Mutex
	var attempts []int
	var order []string
	hooked := make(chan error, 2)
	startConsumer(t, caughtupkafka.ConsumerConfig{
		Topic: names[0], Mode: caughtupkafka.RetryTopic, Router: e.Router, MaxAttempts: 2,
		DeadLetter: func(ctx context.Context, msg kafka.Message, err error) error {
			hooked <- err
			return nil
		},
	}, func(ctx context.Context, msg kafka.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if string(msg.Value) == "poison" {
			attempts = append(attempts, caughtupkafka.Attempt(ctx))
			return errors.New("poison pill")
		}
		order = append(order, string(msg.Value))
		return nil
	})
	w := newWriter(t, names[0])
	require.NoError(t, w.WriteMessages(t.Context(),
		kafka.Message{Key: []byte("k"), Value: []byte("poison")},
		kafka.Message{Key: []byte("k"), Value: []byte("a")}))
	select {
	case err := <-hooked:
		require.EqualError(t, err, "poison pill")
	case <-time.After(30 * time.Second):
		t.Fatal("the dead-letter hook was not called")
	}
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == 1 }, 10*time.Second, 10*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int{0, 1}, attempts)
	require.Equal(t, []string{"a"}, order)
}
