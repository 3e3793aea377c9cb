package caughtupkafka_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// env is one test's database, pools and router on the shared cluster:
// testkit/kafkasuite's, which caughtupkgo's tests use too.
type env = kafkasuite.Env

func setupDB(t testing.TB, tweak func(*consume.Config)) *env { return kafkasuite.SetupDB(t, tweak) }

// ledgerHandler is a consumer handler that reads each message's row where
// the router sent it and records the run in l.
func ledgerHandler(l *kafkasuite.Ledger) caughtupkafka.Handler {
	return func(ctx context.Context, msg kafka.Message) error {
		return l.Handle(ctx, msg.Value, int32(msg.Partition))
	}
}

// keyFor returns a key that the Hash balancer sends to partition p of n.
func keyFor(p, n int, prefix string) string {
	parts := make([]int, n)
	for i := range parts {
		parts[i] = i
	}
	h := &kafka.Hash{}
	for i := 0; ; i++ {
		k := fmt.Sprintf("%s%d", prefix, i)
		if h.Balance(kafka.Message{Key: []byte(k)}, parts...) == p {
			return k
		}
	}
}
