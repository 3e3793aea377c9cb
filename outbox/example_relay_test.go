package outbox_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/outbox"
)

// The producer writes the event in its own transaction; a relay process
// publishes it to Kafka with a token. (Needs a database and brokers, so
// it is compiled but not run; examples/outbox-relay runs the whole flow.)
func Example_relay() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://app@primary/shop")
	if err != nil {
		log.Fatal(err)
	}
	if err := outbox.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}

	// Producer: the order and its event commit together or not at all.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id) VALUES (42)"); err != nil {
			return err
		}
		_, err := outbox.Insert(ctx, tx, outbox.Event{Topic: "orders", Key: []byte("42"), Payload: []byte(`{"id":42}`)})
		return err
	})
	if err != nil {
		log.Fatal(err)
	}

	// Relay: acknowledged writes only, keyed order per partition. The
	// publisher comes from the kafka adapter; outbox imports no queue.
	pub, err := caughtupkafka.NewOutboxPublisher(&kafka.Writer{Addr: kafka.TCP("kafka:9092"), Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll})
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.NewLogicalRelay(outbox.LogicalConfig{ConnString: "postgres://relay@primary/shop", Publisher: pub})
	if err != nil {
		log.Fatal(err)
	}
	_ = relay.Run(ctx) // until ctx is done; reconnects and republishes unconfirmed work on its own
}
