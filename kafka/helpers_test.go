package kafka_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	caughtupkafka "github.com/caughtup/caughtup/kafka"
)

// testConfig fills in what every test consumer uses: quick fetches,
// commits and rebalance detection.
func testConfig(t testing.TB, cfg caughtupkafka.ConsumerConfig) caughtupkafka.ConsumerConfig {
	if cfg.Brokers == nil {
		cfg.Brokers = brokers(t)
	}
	if cfg.GroupID == "" {
		cfg.GroupID = newGroup(t)
	}
	if cfg.CommitInterval == 0 {
		cfg.CommitInterval = 100 * time.Millisecond
	}
	if cfg.MaxWait == 0 {
		cfg.MaxWait = 100 * time.Millisecond
	}
	if cfg.HeartbeatInterval == 0 {
		cfg.HeartbeatInterval = 200 * time.Millisecond
	}
	if cfg.JoinGroupBackoff == 0 {
		cfg.JoinGroupBackoff = 200 * time.Millisecond
	}
	if cfg.RetryBackoffInitial == 0 {
		cfg.RetryBackoffInitial = 20 * time.Millisecond
		cfg.RetryBackoffMax = 100 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	return cfg
}

// testLogger sends warnings and errors to the test log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(logWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type logWriter struct{ t testing.TB }

func (w logWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}

// running is a consumer started by startConsumer.
type running struct {
	c      *caughtupkafka.Consumer
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

// startConsumer runs a consumer until stop, crash or the end of the test.
func startConsumer(t testing.TB, cfg caughtupkafka.ConsumerConfig, h caughtupkafka.Handler, setup ...func(*caughtupkafka.Consumer)) *running {
	t.Helper()
	c, err := caughtupkafka.NewConsumer(testConfig(t, cfg), h)
	require.NoError(t, err)
	for _, f := range setup {
		f(c)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{c: c, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	t.Cleanup(func() { require.NoError(t, r.stop()) })
	return r
}

// stop cancels the consumer and waits for Run to return.
func (r *running) stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(30 * time.Second):
			r.err = fmt.Errorf("the consumer did not stop within 30s")
		}
	})
	return r.err
}

// crash kills the consumer without any further commit and waits for Run
// to return.
func (r *running) crash() error {
	r.c.Crash()
	return r.stop()
}

// produceKeyed inserts rows 1..n and, right after each insert, writes its
// message through the stamping writer: key k<i mod keys>, per-key sequence
// numbers in order (each key is produced by one goroutine).
func produceKeyed(t testing.TB, e *env, w *caughtupkafka.Writer, n, keys, producers int) {
	t.Helper()
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for p := range producers {
		wg.Go(func() {
			for i := 1; i <= n; i++ {
				k := (i - 1) % keys
				if k%producers != p {
					continue
				}
				key, seq := fmt.Sprintf("k%d", k), (i-1)/keys
				pctx, err := e.insert(ctx, int64(i), key, seq)
				if err == nil {
					err = w.WriteMessages(pctx, kafkago.Message{Key: []byte(key), Value: payload(int64(i), key, seq)})
				}
				if err != nil {
					errs <- fmt.Errorf("message %d: %w", i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}
