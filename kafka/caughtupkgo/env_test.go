package caughtupkgo_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// env is one test's database, pools and router on the shared cluster:
// testkit/kafkasuite's, which caughtupkafka's tests use too.
type env = kafkasuite.Env

func setupDB(t testing.TB, tweak func(*consume.Config)) *env { return kafkasuite.SetupDB(t, tweak) }

// ledgerHandler is a consumer handler that reads each record's row where
// the router sent it and records the run in l.
func ledgerHandler(l *kafkasuite.Ledger) caughtupkgo.Handler {
	return func(ctx context.Context, r *kgo.Record) error { return l.Handle(ctx, r.Value, r.Partition) }
}

// testConfig fills in what every test consumer uses: quick fetches,
// commits and rebalances. The caller gives the Router.
func testConfig(t testing.TB, cfg caughtupkgo.ConsumerConfig) caughtupkgo.ConsumerConfig {
	if cfg.ClientOpts == nil {
		cfg.ClientOpts = []kgo.Opt{kgo.SeedBrokers(kafkasuite.Brokers(t)...)}
	}
	cfg.ClientOpts = append([]kgo.Opt{
		kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.HeartbeatInterval(200 * time.Millisecond),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
	}, cfg.ClientOpts...)
	if cfg.GroupID == "" {
		cfg.GroupID = kafkasuite.NewGroup(t)
	}
	if cfg.CommitInterval == 0 {
		cfg.CommitInterval = 100 * time.Millisecond
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

// running is a consumer started by startConsumer.
type running struct {
	*kafkasuite.Running
	c *caughtupkgo.Consumer
}

// startConsumer runs a consumer until Stop or the end of the test.
func startConsumer(t testing.TB, cfg caughtupkgo.ConsumerConfig, h caughtupkgo.Handler) *running {
	t.Helper()
	c, err := caughtupkgo.NewConsumer(testConfig(t, cfg), h)
	require.NoError(t, err)
	return &running{Running: kafkasuite.Start(t, c.Run), c: c}
}
