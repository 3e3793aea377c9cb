package caughtupkafka_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/testkit/fault"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// testConfig fills in what every test consumer uses: quick fetches,
// commits and rebalance detection. The caller gives the Router.
func testConfig(t testing.TB, cfg caughtupkafka.ConsumerConfig) caughtupkafka.ConsumerConfig {
	if cfg.Brokers == nil {
		cfg.Brokers = kafkasuite.Brokers(t)
	}
	if cfg.GroupID == "" {
		cfg.GroupID = kafkasuite.NewGroup(t)
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
		cfg.Logger = kafkasuite.Logger(t)
	}
	return cfg
}

// running is a consumer started by startConsumer. Its connections go
// through a fault dialer, so that kill can make it vanish the way a
// crashed process does.
type running struct {
	*kafkasuite.Running
	c      *caughtupkafka.Consumer
	dialer *fault.Dialer
}

// startConsumer runs a consumer until Stop, kill or the end of the test.
// Unless cfg names a Dialer, it dials through a fault dialer.
func startConsumer(t testing.TB, cfg caughtupkafka.ConsumerConfig, h caughtupkafka.Handler) *running {
	t.Helper()
	r := &running{}
	if cfg.Dialer == nil {
		r.dialer = fault.NewDialer(nil)
		cfg.Dialer = &kafka.Dialer{DialFunc: r.dialer.DialContext, Timeout: 10 * time.Second}
	}
	var err error
	r.c, err = caughtupkafka.NewConsumer(testConfig(t, cfg), h)
	require.NoError(t, err)
	r.Running = kafkasuite.Start(t, r.c.Run)
	return r
}

// kill makes the consumer vanish as a crashed process would: every
// connection reset and no new one possible, so nothing more is committed
// (not even what is done), no retry or dead letter is written through the
// default writer and the group is not told; the coordinator expires the
// member after its session timeout (see killable). Then Run is stopped.
func (r *running) kill() error {
	r.dialer.Refuse(true)
	r.dialer.Cut()
	return r.Stop()
}

// killable shortens the group's session and rebalance timeouts so that
// the partitions of a killed member move on quickly: 2s on the test
// binary's broker (started with group.min.session.timeout.ms 1s, see
// TestMain), 6s on a KAFKA_BROKERS cluster (Kafka's default minimum).
func killable(cfg caughtupkafka.ConsumerConfig) caughtupkafka.ConsumerConfig {
	d := 2 * time.Second
	if os.Getenv("KAFKA_BROKERS") != "" {
		d = 6 * time.Second
	}
	cfg.SessionTimeout, cfg.RebalanceTimeout = d, d
	return cfg
}

// newRepublisher returns a kafka-go Writer for ConsumerConfig.Writer (no
// topic of its own), with the settings the consumer's default has, closed
// at cleanup.
func newRepublisher(t testing.TB) *kafka.Writer {
	w := newWriter(t, "")
	w.BatchTimeout = 2 * time.Millisecond
	return w
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
				pctx, err := e.Insert(ctx, int64(i), key, seq)
				if err == nil {
					err = w.WriteMessages(pctx, kafka.Message{Key: []byte(key), Value: kafkasuite.Payload(int64(i), key, seq)})
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
