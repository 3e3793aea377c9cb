// Package caughtupkafka is caughtup's adapter for segmentio/kafka-go: a Writer that
// stamps each message with the position its producer committed, and a
// Consumer that reads a topic in a consumer group, routes every message
// with a consume.Router and hands the handler the pool it may read.
// It requires kafka-go v0.4.51 or later (its go.mod; v0.4.48 is the
// oldest kafka-go whose consumer groups join a Kafka 4 broker at all).
//
// A producer and a consumer, beside kafka-go:
//
//	import (
//		"context"
//
//		"github.com/jackc/pgx/v5"
//		"github.com/jackc/pgx/v5/pgxpool"
//		"github.com/segmentio/kafka-go"
//
//		"github.com/caughtup/caughtup/consume"
//		"github.com/caughtup/caughtup/enqueue"
//		"github.com/caughtup/caughtup/kafka/caughtupkafka"
//	)
//
//	// Producer: a Writer over a kafka-go writer; commit, then write with
//	// the context the commit returned.
//	func newWriter(brokers []string) *caughtupkafka.Writer {
//		return caughtupkafka.NewWriter(&kafka.Writer{
//			Addr:         kafka.TCP(brokers...),
//			Topic:        "user-events",
//			Balancer:     &kafka.Hash{},    // a key stays on one partition
//			RequiredAcks: kafka.RequireAll, // acknowledged means replicated
//		})
//	}
//
//	func signUp(ctx context.Context, pool *pgxpool.Pool, w *caughtupkafka.Writer, email string) error {
//		ctx, err := enqueue.InTx(ctx, pool, func(tx pgx.Tx) error {
//			_, err := tx.Exec(ctx, "INSERT INTO users (email) VALUES ($1)", email)
//			return err
//		})
//		if err != nil {
//			return err
//		}
//		return w.WriteMessages(ctx, kafka.Message{Key: []byte(email), Value: []byte("signed-up")})
//	}
//
//	// Consumer: one router per process, one Consumer per topic. The Router is
//	// required: it is what gives the handler its pool.
//	func mailer(ctx context.Context, router *consume.Router, brokers []string) error {
//		c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
//			Brokers: brokers, GroupID: "mailer", Topic: "user-events",
//			Router: router, Policy: consume.Delayed,
//		}, func(ctx context.Context, msg kafka.Message) error {
//			var id int64 // on a replica that has the write
//			return consume.DB(ctx, "main").QueryRow(ctx, "SELECT id FROM users WHERE email = $1", string(msg.Key)).Scan(&id)
//		})
//		if err != nil {
//			return err
//		}
//		return c.Run(ctx) // until ctx ends
//	}
//
// # Producing
//
// Writer (or Stamp, for code that builds messages for its own writer) puts
// the context's token (enqueue.TokenFrom) in the header
// position.HeaderName, merged with any token headers the message has by
// position.MergeHeaderValues: one that does not decode stays, so consumers
// read the message from the primary (unknown stays unknown). Use a
// key-hashing Balancer, RequiredAcks all and a short BatchTimeout.
//
// # Routing
//
// The Consumer reads each message's token once (TokenOf: every token
// header, merged) and routes it (consume.Tally.Route, one decision per
// attempt) before the handler runs. Each partition's worker reads one of
// the replicas that have caught up with a message (the workers take the
// replicas in turn), so that its connections stay with one server. A run
// of messages with one token (one transaction's events, an outbox batch)
// shares its first message's decoded token, decision and handler context
// while the replica chosen stays fresh. A message without a usable token reads
// the primary and is counted; the router's warning names the topic. Code
// with its own consume loop gets the same routing from Middleware.
//
// # CDC topics (Debezium)
//
// A consumer of a Debezium topic sets TokenFormat to TokenDebezium and
// gets the decisions of a stamped message: the token is the envelope's
// source position, and the message runs on a caught-up replica, waits, is
// deferred or reads the primary under the cap, with the same metrics.
//
//	func indexOrders(ctx context.Context, router *consume.Router, brokers []string) error {
//		c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
//			Brokers: brokers, GroupID: "search-indexer", Topic: "shop.public.orders",
//			Router: router, Policy: consume.Delayed,
//			TokenFormat: caughtupkafka.TokenDebezium,
//			Debezium:    caughtupkafka.DebeziumConfig{Database: "main"}, // default: the router's only database
//		}, func(ctx context.Context, msg kafka.Message) error {
//			var n int // on a replica where the change is committed
//			return consume.DB(ctx, "main").QueryRow(ctx, "SELECT count(*) FROM orders").Scan(&n)
//		})
//		if err != nil {
//			return err
//		}
//		return c.Run(ctx)
//	}
//
// source.lsn is the change record's position, before its commit: the
// replica the router picks must also report the event's transaction
// committed (cdc.Checker, as consume.Job.Verify) before the handler gets
// it. What the rule cannot vouch for reads the primary and is counted.
//
// # Consuming
//
// One kafka-go Reader per assigned partition and generation, each in
// order: a message waiting for a replica holds only its own partition, and
// a message is committed only when it and everything before it in its
// partition are done. Mode says how a message no replica can serve yet is
// deferred: InPlace holds the partition (order kept), RetryTopic
// republishes it to a retry topic with its due time (order per key lost,
// the partition moves on); a deferral for lag ends early when a replica
// passes the token. Handler errors are retried up to MaxAttempts, then the
// message goes to the dead-letter topic or hook; deferrals never count as
// attempts. Handlers must tolerate a row that is not found (a write lost in
// a crash or failover). That processing is package kafka's engine, which
// caughtupkgo runs too. The details, rebalances and kafka-go's known
// issues are in docs/kafka.md.
//
// # Metrics
//
// caughtup.kafka.messages ({message}) counts what happened to messages by
// topic (messaging.destination.name) and caughtup.kafka.result (handled,
// waited, deferred, retried, dead_lettered, dropped, woken, rerouted), on
// the MeterProvider in ConsumerConfig; routing decisions are counted by
// the router. It is a
// synchronous counter: its sums outlive Run, and consumers made one after
// the other on one MeterProvider add to the same series.
//
// Each partition's worker counts its messages' results, routing decisions
// and replica connection checks itself (consume.Tally) and adds them to
// the counters at every offset commit (CommitInterval) and once it stops,
// before Run returns:
// at hundreds of thousands of messages a second, three counter Adds a
// message would cost more than the rest of the consumer's work on it. So
// the counts trail the messages by up to CommitInterval.
//
// # Traces
//
// Writer and Stamp write the trace context of their ctx into the
// message's headers (HeaderCarrier) through the global propagators
// (otel.SetTextMapPropagator; none by default), and the consumer
// continues it (ConsumerConfig.Propagators) unless the handler's context
// already has a span. Under ScopeName, from ConsumerConfig.TracerProvider:
// consume.SpanDefer for each deferral (caughtup.kafka.defer in_place,
// ending at the catch-up or the delay, or retry_topic) and
// consume.SpanWake for a retry-topic message held until its catch-up.
package caughtupkafka
