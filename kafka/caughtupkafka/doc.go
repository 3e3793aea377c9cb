// Package kafka is caughtup's adapter for segmentio/kafka-go: a Writer that
// stamps each message with the position its producer committed, and a
// Consumer that reads a topic in a consumer group, routes every message
// with a consume.Router and hands the handler the pool it may read.
// kafka-go v0.4.51 or later.
//
// Import it under a name that does not clash with kafka-go:
//
//	import (
//		"github.com/segmentio/kafka-go"
//		"github.com/caughtup/caughtup/kafka/caughtupkafka"
//	)
//
//	// Producer: commit, then write with the context the commit returned.
//	w := caughtupkafka.NewWriter(&kafka.Writer{
//		Addr:         kafka.TCP(brokers...),
//		Topic:        "user-events",
//		Balancer:     &kafka.Hash{},    // a key stays on one partition
//		RequiredAcks: kafka.RequireAll, // acknowledged means replicated
//	})
//	ctx, err := enqueue.InTx(ctx, pool, insertUser)
//	err = w.WriteMessages(ctx, kafka.Message{Key: userID, Value: event})
//
//	// Consumer: one router per process, one Consumer per topic. The
//	// Router is required: it is what gives the handler its pool.
//	c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
//		Brokers: brokers, GroupID: "mailer", Topic: "user-events",
//		Router: router, Policy: consume.Delayed,
//	}, func(ctx context.Context, msg kafka.Message) error {
//		row := consume.DB(ctx, "main").QueryRow(ctx, "SELECT ...") // a replica that has the write
//		...
//	})
//	err = c.Run(ctx) // until ctx ends
//
// # Producing
//
// Writer (or Stamp, for code that builds messages for its own writer) puts
// the token of the context, enqueue.TokenFrom, in the header
// position.HeaderName. A message that already carries token headers gets
// one header that merges them with the context's token
// (position.MergeHeader), unless one of them does not decode: that one
// then stays as the message's only token header and the context's token is
// not added, so consumers read the message from the primary (unknown stays
// unknown). A merge that names more databases than a token can carry is an
// error at the call, and nothing is written. Three kafka-go Writer
// settings matter: a key-hashing Balancer (kafka-go's default is
// round-robin, which spreads one key over every partition and leaves no
// order to keep), RequiredAcks all (the default, none, can lose
// acknowledged messages) and a short BatchTimeout for synchronous writes
// (the default makes each call wait up to 1s).
//
// # Routing
//
// The Consumer reads each message's token once with TokenOf (every token
// header, merged; position.DecodeHeaders) and routes it with
// consume.Router.RouteDecoded before each attempt of the handler. A
// message without a token reads the primary; one whose token headers do
// not decode reads the primary too, and the router's warning names the
// topic (consume.WithSource). Code with its own consume loop gets the same
// routing from Middleware.
//
// # CDC topics (Debezium)
//
// A consumer of a Debezium topic sets TokenFormat to TokenDebezium and
// gets the decisions of a stamped message: the token is the envelope's
// source position, and the message runs on a caught-up replica, waits, is
// deferred or reads the primary under the cap, with the same metrics.
//
//	c, err := caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{
//		Brokers: brokers, GroupID: "search-indexer", Topic: "shop.public.orders",
//		Router: router, Policy: consume.Delayed,
//		TokenFormat: caughtupkafka.TokenDebezium,
//		Debezium:    caughtupkafka.DebeziumConfig{Database: "main"}, // default: the router's only database
//	}, func(ctx context.Context, msg kafka.Message) error {
//		row := consume.DB(ctx, "main").QueryRow(ctx, "SELECT ...") // a replica where the change is committed
//		...
//	})
//
// source.lsn is the change record's position, before its commit, so
// replay >= source.lsn is necessary, not sufficient: the replica the
// router picks must also report the event's transaction committed
// (cdc.Checker, consume.Router.RouteVerified) before the handler gets it,
// and one that does not counts as behind for the message. Envelopes the
// rule cannot vouch for (tombstones, snapshot reads, malformed ones, other
// connectors, no lsn or txId) read the primary and are counted. The epoch
// is the router's primary's when the message is read: TokenDebezium and
// DebeziumConfig say what that means across a failover. The JSON
// converter is expected, with or without schemas.
//
// # Consuming: one reader per partition
//
// kafka-go offers two ways to consume in a group. A group Reader merges
// every assigned partition into one stream: it cannot pause a partition,
// so a message waiting for a replica would stall every partition behind a
// dispatcher (or, with per-partition queues, fill its queue and stall the
// dispatcher anyway), and after a rebalance it can still deliver messages
// it buffered for partitions it lost (kafka-go issue #1398). The lower-level
// ConsumerGroup hands out one Generation per rebalance with the partitions
// assigned to this member and their committed offsets. The Consumer uses
// that: each generation starts one goroutine per assigned partition with
// its own partition Reader (its own fetch loop and a buffer of
// QueueCapacity messages) and one committer.
//
//   - Independence. A partition whose next message waits for a replica
//     stops reading its own Reader and nothing else; the others keep
//     flowing, with no dispatcher to block.
//   - Order and commits. Each partition's messages are processed one at a
//     time in offset order, and the committer commits, every
//     CommitInterval, the offset after the last message done. A message is
//     done when the handler returned nil, or it was republished to the
//     retry topic or dead-lettered (each written and acknowledged first).
//     So an offset is committed only once it and every message before it in
//     its partition are done: a crash redelivers, never skips
//     (at-least-once; handlers must be idempotent).
//   - Rebalances. When a generation ends (kafka-go notices a rebalance on
//     its next heartbeat, HeartbeatInterval), every partition's context is
//     cancelled: waits end, the Reader and its buffered messages are
//     closed, and a message not yet done is dropped uncommitted, to be
//     delivered again to whichever member gets the partition. Once every
//     worker has stopped the committer commits what was done and the member
//     rejoins. Commits carry the generation, so the coordinator refuses
//     them once the group has moved on: a member never commits a partition
//     it no longer owns, and the buffer of a revoked partition dies with
//     its Reader (no #1398).
//   - Heartbeats run on their own goroutine: a long wait does not cost
//     group membership. A handler that ignores its context, though, holds
//     up the rebalance of the whole group (up to RebalanceTimeout).
//
// The price is one broker connection and one fetch loop per assigned
// partition; fine for tens of partitions per member, worth measuring for
// hundreds. Close latency is bounded by MaxWait (default 500ms, against
// kafka-go's 10s).
//
// # Deferral modes
//
// Route waits in process first (consume.Config.WaitBudget). When a message
// still cannot run it returns a *consume.DeferError, and Mode decides:
//
//   - InPlace (default) keeps the message at the head of its partition:
//     hold it for the deferral's delay, or until a replica has replayed
//     its token if that comes first (result woken; a token a Verifier
//     must vouch for sleeps the delay), route again, until it runs on a
//     replica or the token is older than the router's MaxAge (then it
//     reads the primary). Per-key order is kept; the messages behind it in
//     that partition wait with it.
//   - RetryTopic republishes the message to RetryTopic with its token, a
//     due time (HeaderDue) and HeaderDeferred, commits the original and
//     moves on; the group reads the retry topic too. The worker of a retry
//     partition takes its head message and waits until it is due or a
//     replica has replayed its token, whichever comes first (woken by the
//     tracker's observations, within milliseconds of the catch-up: result
//     woken), then routes it again: a replica, another deferral if it is
//     due and still behind, the primary after MaxAge. Retry partitions are
//     roughly in due order (each message is appended at now + delay); a
//     message behind the head waits for the head even when its own token
//     is caught up. Partitions never wait, but a deferred message runs
//     after later messages of its key: for work whose order does not
//     matter. A crash between the republish and the commit writes the
//     message to the retry topic twice; it is never lost.
//
// Deferrals never count as failed attempts (Attempt).
//
// # Handler errors
//
// A handler error is retried up to MaxAttempts runs, RetryBackoffInitial
// doubling up to RetryBackoffMax between them: in place in InPlace mode
// (the partition waits, order is kept), through the retry topic in
// RetryTopic mode, where it waits out its backoff whatever the replicas
// do (it carries no HeaderDeferred). Then the message goes to
// DeadLetterTopic with HeaderError, HeaderAttempts and its origin, or to
// the DeadLetter hook; only then is it committed. A panic counts as an
// error. An error returned after the partition's context ended is not a
// failure: the message is dropped and delivered again.
//
// Consumers must still tolerate a row that is not found: an asynchronously
// committed write lost in a crash or failover can have its position reused,
// and no token can tell.
//
// # Metrics
//
// caughtup.kafka.messages ({message}) counts what happened to messages by
// topic (messaging.destination.name) and result (handled, waited,
// deferred, retried, dead_lettered, dropped), on the MeterProvider in
// ConsumerConfig; routing decisions are counted by the router. It is a
// synchronous counter: its sums outlive Run, and consumers made one after
// the other on one MeterProvider add to the same series.
//
// Each partition's worker counts its messages' results and routing
// decisions itself (consume.Tally) and adds them to the counters at every
// offset commit (CommitInterval) and once it stops, before Run returns:
// at hundreds of thousands of messages a second, three counter Adds a
// message would cost more than the rest of the consumer's work on it. So
// the counts trail the messages by up to CommitInterval.
package caughtupkafka
