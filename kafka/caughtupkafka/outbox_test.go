package caughtupkafka_test

import (
	"context"
	"errors"
	"log"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/outbox"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

func TestOutboxPublisherRefusesUnsafeWriters(t *testing.T) {
	t.Parallel()
	_, err := caughtupkafka.NewOutboxPublisher(&kafka.Writer{Addr: kafka.TCP("localhost:9092")})
	require.ErrorIs(t, err, caughtupkafka.ErrUnsafeWriter, "RequireNone is kafka-go's default")
	_, err = caughtupkafka.NewOutboxPublisher(&kafka.Writer{Addr: kafka.TCP("localhost:9092"), RequiredAcks: kafka.RequireAll, Async: true})
	require.ErrorIs(t, err, caughtupkafka.ErrUnsafeWriter)
	_, err = caughtupkafka.NewOutboxPublisher(nil)
	require.Error(t, err)

	// Code that drops that error holds a typed nil; the relays refuse it
	// instead of panicking on the first batch.
	pub, _ := caughtupkafka.NewOutboxPublisher(&kafka.Writer{Addr: kafka.TCP("localhost:9092")})
	err = outbox.PollingConfig{Primary: &pgxpool.Pool{}, Publisher: pub}.Validate()
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "Publisher is nil (*caughtupkafka.OutboxPublisher)")
	_, err = outbox.NewLogicalRelay(outbox.LogicalConfig{ConnString: "postgres://x/y", Publisher: pub})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
}

// TestOutboxPublisher relays outbox rows from a real primary to a Kafka
// broker and reads them back: key, value, producer
// headers, the event ID and the relay's token arrive; a producer's
// malformed token header arrives unchanged, so its consumer reads the
// primary (the one header rule).
func TestOutboxPublisher(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := pgtest.Shared(t)
	db := pgtest.NewDatabase(t, c)
	primary, err := c.Primary().Pool(ctx, db)
	require.NoError(t, err)
	defer primary.Close()
	require.NoError(t, outbox.Migrate(ctx, primary))

	topic := kafkasuite.NewTopics(t, 2, "")[0]
	transport := &kafka.Transport{}
	defer transport.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(kafkasuite.Brokers(t)...), Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll,
		BatchTimeout: time.Millisecond, Transport: transport}
	defer func() { _ = w.Close() }()
	pub, err := caughtupkafka.NewOutboxPublisher(w)
	require.NoError(t, err)

	const malformed = "v1;not-a-token"
	ids := map[string]int{}
	for i := range 12 {
		err := pgx.BeginFunc(ctx, primary, func(tx pgx.Tx) error {
			key := strconv.Itoa(i)
			h := map[string]string{"order": key}
			if i == 0 {
				h[position.HeaderName] = malformed
			}
			id, err := outbox.Insert(ctx, tx, outbox.Event{Topic: topic, Key: []byte(key), Payload: []byte(key), Headers: h})
			ids[id] = i
			return err
		})
		require.NoError(t, err)
	}
	r, err := outbox.NewPollingRelay(outbox.PollingConfig{Primary: primary, Publisher: pub, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	n, err := r.RelayOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 12, n)

	seen := map[string]bool{}
	for p := range 2 {
		rd := kafka.NewReader(kafka.ReaderConfig{Brokers: kafkasuite.Brokers(t), Topic: topic, Partition: p, MaxWait: 50 * time.Millisecond,
			Dialer: &kafka.Dialer{Timeout: 5 * time.Second}})
		last, err := rd.ReadLag(ctx)
		require.NoError(t, err)
		for range last {
			m, err := rd.ReadMessage(ctx)
			require.NoError(t, err)
			var tokens []string
			h := map[string]string{}
			for _, x := range m.Headers {
				h[x.Key] = string(x.Value)
				if x.Key == position.HeaderName {
					tokens = append(tokens, string(x.Value))
				}
			}
			require.Equal(t, string(m.Key), h["order"], "key = Event.Key, producer headers kept")
			require.Equal(t, string(m.Key), string(m.Value))
			require.Len(t, tokens, 1)
			id := h[outbox.HeaderEventID]
			tok, err := position.DecodeHeaders(tokens...)
			if ids[id] == 0 {
				require.Equal(t, malformed, tokens[0], "a malformed producer header stays malformed")
				var de *position.DecodeError
				require.True(t, errors.As(err, &de))
			} else {
				require.NoError(t, err)
				entry, ok := tok.Entry("main")
				require.True(t, ok)
				require.Equal(t, position.SourcePrimary, entry.Source)
			}
			seen[id] = true
		}
		require.NoError(t, rd.Close())
	}
	for id := range ids {
		require.True(t, seen[id], "event %s not in Kafka", id)
	}
}

// A relay process: the outbox table on the primary, Kafka as the broker.
// (Needs a database and brokers, so it is compiled but not run;
// examples/outbox-relay runs the whole flow.)
func ExampleNewOutboxPublisher() {
	ctx := context.Background()
	pub, err := caughtupkafka.NewOutboxPublisher(&kafka.Writer{
		Addr:         kafka.TCP("kafka:9092"),
		Balancer:     &kafka.Hash{},        // keyed order per partition
		RequiredAcks: kafka.RequireAll,     // acknowledged writes only
		BatchTimeout: 5 * time.Millisecond, // a relay publishes synchronously
	})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.NewLogicalRelay(outbox.LogicalConfig{ConnString: "postgres://relay@primary/shop", Publisher: pub})
	if err != nil {
		log.Fatal(err)
	}
	_ = relay.Run(ctx) // until ctx is done
}
