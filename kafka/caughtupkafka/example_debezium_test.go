package caughtupkafka_test

import (
	"context"
	"log"

	"github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
)

// A consumer of a Debezium topic (the PostgreSQL connector, JSON
// converter) routes each change event by its source position under the
// commit-safe rule: the handler reads a replica only once that replica
// reports the event's transaction committed. (Needs a router, brokers and
// the topic, so it is compiled but not run; examples/debezium-consumer
// runs the whole flow, and the tests in cdc_test.go run it against a real
// connector.)
func ExampleTokenDebezium() {
	ctx := context.Background()
	var router *consume.Router // consume.NewRouter(ctx, consume.Config{Databases: {"main": …}})
	c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
		Brokers: []string{"kafka:9092"}, GroupID: "search-indexer", Topic: "shop.public.orders",
		Router: router, Policy: consume.Delayed,
		TokenFormat: caughtupkafka.TokenDebezium,
		Debezium:    caughtupkafka.DebeziumConfig{Database: "main"},
	}, func(ctx context.Context, msg kafka.Message) error {
		var n int
		return consume.DB(ctx, "main").QueryRow(ctx, "SELECT count(*) FROM orders").Scan(&n)
	})
	if err != nil {
		log.Fatal(err)
	}
	_ = c.Run(ctx) // until ctx is done
}
