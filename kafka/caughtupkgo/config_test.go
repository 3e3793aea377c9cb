package caughtupkgo_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka"
	"github.com/caughtup/caughtup/kafka/caughtupkgo"
)

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c := caughtupkgo.ConsumerConfig{Topic: "events"}.WithDefaults()
	require.Equal(t, "events.retry", c.RetryTopic)
	require.Equal(t, "events.dlt", c.DeadLetterTopic)
	require.Equal(t, kafka.DefaultMaxAttempts, c.MaxAttempts)
	require.Equal(t, kafka.DefaultRetryBackoffInitial, c.RetryBackoffInitial)
	require.Equal(t, kafka.DefaultRetryBackoffMax, c.RetryBackoffMax)
	require.Equal(t, kafka.DefaultCommitInterval, c.CommitInterval)
	require.Equal(t, caughtupkgo.DefaultQueueCapacity, c.QueueCapacity)
	require.Equal(t, caughtupkgo.DefaultMaxPollRecords, c.MaxPollRecords)
	require.Equal(t, caughtupkgo.InPlace, c.Mode)
}

// NewConsumer refuses what cannot work, with ErrInvalidConfig; the Router
// above all, without which a handler has no pool.
func TestConfigRefused(t *testing.T) {
	e := setupDB(t, nil)
	ok := caughtupkgo.ConsumerConfig{ClientOpts: []kgo.Opt{kgo.SeedBrokers("127.0.0.1:1")}, GroupID: "g", Topic: "t", Router: e.Router}
	h := func(context.Context, *kgo.Record) error { return nil }
	_, err := caughtupkgo.NewConsumer(ok, h)
	require.NoError(t, err)
	for name, tweak := range map[string]func(*caughtupkgo.ConsumerConfig){
		"no router":         func(c *caughtupkgo.ConsumerConfig) { c.Router = nil },
		"no client options": func(c *caughtupkgo.ConsumerConfig) { c.ClientOpts = nil },
		"no group":          func(c *caughtupkgo.ConsumerConfig) { c.GroupID = "" },
		"no topic":          func(c *caughtupkgo.ConsumerConfig) { c.Topic = "" },
		"bad policy":        func(c *caughtupkgo.ConsumerConfig) { c.Policy = consume.Policy(99) },
		"bad mode":          func(c *caughtupkgo.ConsumerConfig) { c.Mode = caughtupkgo.Mode(9) },
		"retry is topic":    func(c *caughtupkgo.ConsumerConfig) { c.Mode, c.RetryTopic = caughtupkgo.RetryTopic, "t" },
		"dlt is topic":      func(c *caughtupkgo.ConsumerConfig) { c.DeadLetterTopic = "t" },
		"negative attempts": func(c *caughtupkgo.ConsumerConfig) { c.MaxAttempts = -1 },
		"backoff inverted":  func(c *caughtupkgo.ConsumerConfig) { c.RetryBackoffInitial, c.RetryBackoffMax = 10, 5 },
		"negative queue":    func(c *caughtupkgo.ConsumerConfig) { c.QueueCapacity = -1 },
	} {
		c := ok
		tweak(&c)
		_, err := caughtupkgo.NewConsumer(c, h)
		require.True(t, errors.Is(err, caughtupkgo.ErrInvalidConfig), "%s: %v", name, err)
	}
	_, err = caughtupkgo.NewConsumer(ok, nil)
	require.ErrorIs(t, err, caughtupkgo.ErrInvalidConfig)
}
