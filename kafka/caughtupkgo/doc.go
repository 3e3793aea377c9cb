// Package caughtupkgo is caughtup's adapter for franz-go (package kgo): a
// Producer and Stamp that stamp each record with the position its producer
// committed, and a Consumer that reads a topic in a consumer group, routes
// every record with a consume.Router and hands the handler the pool it
// may read. It is built on franz-go v1.22 or later.
//
//	import (
//		"context"
//
//		"github.com/jackc/pgx/v5"
//		"github.com/jackc/pgx/v5/pgxpool"
//		"github.com/twmb/franz-go/pkg/kgo"
//
//		"github.com/caughtup/caughtup/consume"
//		"github.com/caughtup/caughtup/enqueue"
//		"github.com/caughtup/caughtup/kafka/caughtupkgo"
//	)
//
//	// Producer: commit, then produce with the context the commit returned. p
//	// is caughtupkgo.NewProducer(cl), cl from kgo.NewClient(kgo.SeedBrokers(brokers...)).
//	func signUp(ctx context.Context, pool *pgxpool.Pool, p *caughtupkgo.Producer, email string) error {
//		ctx, err := enqueue.InTx(ctx, pool, func(tx pgx.Tx) error {
//			_, err := tx.Exec(ctx, "INSERT INTO users (email) VALUES ($1)", email)
//			return err
//		})
//		if err != nil {
//			return err
//		}
//		return p.ProduceSync(ctx, &kgo.Record{Topic: "user-events", Key: []byte(email), Value: []byte("signed-up")}).FirstErr()
//	}
//
//	// Consumer: one router per process, one Consumer per topic.
//	func mailer(ctx context.Context, router *consume.Router, brokers []string) error {
//		c, err := caughtupkgo.NewConsumer(caughtupkgo.ConsumerConfig{
//			ClientOpts: []kgo.Opt{kgo.SeedBrokers(brokers...)},
//			GroupID:    "mailer", Topic: "user-events",
//			Router: router, Policy: consume.Delayed,
//		}, func(ctx context.Context, r *kgo.Record) error {
//			var id int64 // on a replica that has the write
//			return consume.DB(ctx, "main").QueryRow(ctx, "SELECT id FROM users WHERE email = $1", string(r.Key)).Scan(&id)
//		})
//		if err != nil {
//			return err
//		}
//		return c.Run(ctx) // until ctx ends
//	}
//
// # Producing
//
// Producer.Produce and Producer.ProduceSync (or Stamp, for code that
// produces through its own client) put the context's token
// (enqueue.TokenFrom) in the header position.HeaderName, merged with any
// token headers the record has by position.MergeHeader: one that does not
// decode stays, so consumers read the record from the primary (unknown
// stays unknown). A record that cannot be stamped is not produced.
// franz-go's defaults (key partitioning, acks from all in-sync replicas,
// idempotence) are what tokens need.
//
// # Routing
//
// The Consumer reads each record's token once (TokenOf: every token
// header, merged) and routes it (consume.Tally.Route, one decision per
// attempt) before the handler runs. Each partition's worker reads one of
// the replicas that have caught up with a record (the workers take the
// replicas in turn), so that its connections stay with one server. A run
// of records with one token (one transaction's events, an outbox batch)
// shares its first record's decoded token, decision and handler context
// while the replica chosen stays fresh. A record without a token, or with one
// that does not decode, reads the primary and is counted
// (caughtup.consume.decisions outcome primary_no_token, reason no_token or
// malformed_token, and caughtup.consume.tokens.missing), with a warning
// rate-limited per topic; it is never dropped.
//
// # Consuming
//
// One poll loop (kgo.Client.PollRecords) hands polled records to one
// queue per assigned partition, and one worker per partition processes
// its queue in offset order. The poll loop never waits for a record: a
// partition whose head record waits for a replica has its fetches paused
// (kgo.Client.PauseFetchPartitions) until the record is done, and the
// other partitions keep flowing. Records already polled for a paused
// partition stay queued behind the head, in order; franz-go drops what
// it buffered for a paused partition without moving its cursor, and
// fetches it again on resume. Each poll takes everything franz-go has
// buffered, so that franz-go fetches the next records while the workers
// run these; a partition whose queue reaches QueueCapacity is paused
// until its worker takes its queue, and while every partition that is
// not paused has work queued the loop does not poll, so that records
// wait in franz-go's buffer.
//
// Offsets are committed (every CommitInterval, and on every revocation
// and at the end of Run) only up to the last record done in order, with
// kgo.DisableAutoCommit. The client blocks rebalances while a poll's
// records are handed out (kgo.BlockRebalanceOnPoll), and on a revocation
// the revoked partitions' workers are stopped, what they finished is
// committed and their queues are dropped before franz-go hands them on;
// a loss drops them without committing. So a record is delivered again
// after a crash or a rebalance, never skipped (at-least-once: handlers
// must be idempotent, and tolerate a row that is not found after a write
// lost in a crash or failover).
//
// Mode says how a record no replica can serve yet is deferred: InPlace
// holds it at the head of its partition (order kept), RetryTopic produces
// it to a retry topic with its token and a due time (HeaderDue) and moves
// on (order per key lost). Handler errors are retried up to MaxAttempts,
// then the record goes to the dead-letter topic or hook; deferrals never
// count as attempts (Attempt). That processing is package kafka's engine,
// caughtupkafka's too: its retry and dead-letter headers (kafka.HeaderDue
// and the rest) are the same, and one adapter reads what the other wrote.
//
// # Metrics
//
// caughtup.kafka.messages ({message}) counts what happened to records by
// topic (messaging.destination.name) and caughtup.kafka.result (handled,
// waited, deferred, retried, dead_lettered, dropped, woken, rerouted): package
// kafka's instrument, attributes and values, caughtupkafka's too, under
// this package's ScopeName, on the
// MeterProvider in ConsumerConfig (default the global one). Each worker
// counts in bulk and the counts reach the instruments at every commit, so
// they trail the records by up to CommitInterval. Routing decisions, and
// the checks of the replica connections handlers acquire, are counted by
// the router, the same way (consume.Tally).
//
// # Traces
//
// Producer and Stamp write the trace context of their ctx into the
// record's headers (HeaderCarrier) through the global propagators
// (otel.SetTextMapPropagator; none by default). The consumer continues the
// span franz-go's kotel plugin put in the record's Context, else the trace
// context of its headers (ConsumerConfig.Propagators). Under ScopeName,
// from ConsumerConfig.TracerProvider and only inside a trace:
// consume.SpanDefer for each deferral (caughtup.kafka.defer in_place,
// ending at the catch-up or the delay, or retry_topic) and
// consume.SpanWake for a retry-topic record held until its catch-up.
package caughtupkgo
