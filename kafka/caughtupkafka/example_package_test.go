package caughtupkafka_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/replay"
)

// A producer and a consumer of one topic: the writer stamps each message
// with the position of the commit before it, and the consumer hands each
// message's handler a pool that has that commit. It needs a primary with
// streaming replicas and a Kafka broker, so it is compiled, not run.
func Example() {
	ctx := context.Background()
	brokers := []string{"localhost:9092"}
	primary, err := pgxpool.New(ctx, "postgres://app@primary/app")
	if err != nil {
		log.Fatal(err)
	}
	defer primary.Close()
	replica, err := pgxpool.New(ctx, "postgres://app@replica1/app")
	if err != nil {
		log.Fatal(err)
	}
	defer replica.Close()

	// Producer: commit, then write with the context the commit returned.
	kw := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: "user-events",
		Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll}
	defer kw.Close()
	w := caughtupkafka.NewWriter(kw)
	email := "ada@example.com"
	wctx, err := enqueue.InTx(ctx, primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO users (email) VALUES ($1)", email)
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := w.WriteMessages(wctx, kafka.Message{Key: []byte(email), Value: []byte("signed-up")}); err != nil {
		log.Fatal(err)
	}

	// Consumer: one router per process, one Consumer per topic.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replica)}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
		Brokers: brokers, GroupID: "mailer", Topic: "user-events",
		Router: router, Policy: consume.Delayed,
	}, func(ctx context.Context, msg kafka.Message) error {
		var id int64 // on a replica that has the write, or the primary
		return consume.DB(ctx, "main").QueryRow(ctx, "SELECT id FROM users WHERE email = $1", string(msg.Key)).Scan(&id)
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
