package fault_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/fault"
)

// sink is the writer under the fault wrapper: it keeps what it was given.
// (The wrapper's use on a real broker is in the kafka adapter's tests.)
type sink struct {
	mu  sync.Mutex
	got []string
}

func (s *sink) WriteMessages(_ context.Context, msgs ...kafkago.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		s.got = append(s.got, string(m.Value))
	}
	return nil
}

func (s *sink) values() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.got...)
}

func msg(v string) kafkago.Message { return kafkago.Message{Value: []byte(v)} }

func TestWriterFailWritesNothing(t *testing.T) {
	t.Parallel()
	var s sink
	w := fault.NewWriter(&s)
	boom := errors.New("boom")
	w.Fail(boom)
	require.ErrorIs(t, w.WriteMessages(t.Context(), msg("a")), boom)
	require.Empty(t, s.values())
	w.Fail(nil)
	require.NoError(t, w.WriteMessages(t.Context(), msg("b")))
	require.Equal(t, []string{"b"}, s.values())
	written, _ := w.Stats()
	require.Equal(t, 1, written)
}

func TestWriterAfterWriteRunsBeforeTheCallerReturns(t *testing.T) {
	t.Parallel()
	var s sink
	w := fault.NewWriter(&s)
	var seen []string
	w.AfterWrite(func(_ context.Context, msgs []kafkago.Message) {
		require.Equal(t, []string{"a", "b"}, s.values(), "the hook runs once the write is done")
		for _, m := range msgs {
			seen = append(seen, string(m.Value))
		}
	})
	require.NoError(t, w.WriteMessages(t.Context(), msg("a"), msg("b")))
	require.Equal(t, []string{"a", "b"}, seen)
}

func TestWriterHoldKeepsTheCallerAfterTheWrite(t *testing.T) {
	t.Parallel()
	var s sink
	w := fault.NewWriter(&s)
	w.Hold()
	done := make(chan error, 1)
	go func() { done <- w.WriteMessages(context.Background(), msg("a")) }()
	require.Eventually(t, func() bool { _, holding := w.Stats(); return holding == 1 }, 10*time.Second, time.Millisecond)
	require.Equal(t, []string{"a"}, s.values(), "a held write has reached the broker")
	select {
	case err := <-done:
		t.Fatalf("a held write returned %v before Release", err)
	default:
	}
	w.Release()
	require.NoError(t, <-done)

	// A hook may hold its own write; the caller's context ends the hold
	// with the context's error, the write done all the same.
	w.AfterWrite(func(context.Context, []kafkago.Message) { w.Hold() })
	ctx, cancel := context.WithCancel(t.Context())
	go func() { done <- w.WriteMessages(ctx, msg("b")) }()
	require.Eventually(t, func() bool { _, holding := w.Stats(); return holding == 1 }, 10*time.Second, time.Millisecond)
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	require.Equal(t, []string{"a", "b"}, s.values())
	w.Release()
}
