// Package outbox is caughtup's transactional outbox: a table the producer
// writes events into inside its business transaction, and two relays that
// publish them stamped with a token.
//
// An outbox row cannot carry its own commit position — the commit record
// does not exist while the row is being inserted — so the relays stamp it
// on the way out:
//
//   - PollingRelay claims committed rows (SELECT … FOR UPDATE SKIP LOCKED),
//     then reads pg_current_wal_insert_lsn(). Every row its snapshot shows
//     committed before that read, so the token is at or past every row's
//     commit: correct, and conservative by whatever else was written in
//     between.
//   - LogicalRelay streams the table's inserts over logical replication
//     (pgoutput) and stamps each transaction's events with that
//     transaction's exact end position (cdc.TransactionToken of
//     CommitMessage.TransactionEndLSN).
//
// Both publish through a Publisher and mark rows done only after the
// publish was acknowledged, so delivery is at least once: consumers dedupe
// on HeaderEventID. The queue adapters provide the publishers
// (caughtupkafka.NewOutboxPublisher, caughtupasynq.NewOutboxPublisher);
// this package imports no queue library, and PublisherFunc adapts anything
// else. The token travels in position.HeaderName as an ordinary caughtup
// token (TokenFromHeaders), so consumers compare it as they compare any
// job's.
//
//	// In the business transaction:
//	func updateAccount(ctx context.Context, pool *pgxpool.Pool, key string, body []byte) error {
//		tx, err := pool.Begin(ctx)
//		if err != nil {
//			return err
//		}
//		defer tx.Rollback(ctx) // after Commit, a no-op
//		if _, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance - 1 WHERE key = $1", key); err != nil {
//			return err
//		}
//		if _, err := outbox.Insert(ctx, tx, outbox.Event{Topic: "account.updated", Key: []byte(key), Payload: body}); err != nil {
//			return err
//		}
//		return tx.Commit(ctx)
//	}
//
//	// In the relay process:
//	func relay(ctx context.Context, pool *pgxpool.Pool, brokers []string) error {
//		if err := outbox.Migrate(ctx, pool); err != nil { // once, at startup or in a migration
//			return err
//		}
//		w := &kafka.Writer{Addr: kafka.TCP(brokers...),
//			Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll, BatchTimeout: 5 * time.Millisecond}
//		defer w.Close()
//		pub, err := caughtupkafka.NewOutboxPublisher(w) // refuses an Async writer or RequireNone
//		if err != nil {
//			return err
//		}
//		relay, err := outbox.NewPollingRelay(outbox.PollingConfig{Primary: pool, Publisher: pub})
//		if err != nil {
//			return err
//		}
//		return relay.Run(ctx) // until ctx ends
//	}
//
// # Headers
//
// Relays merge their token into a token header the producer may have put
// on the event by the rule every caughtup stamper follows
// (position.MergeHeader): entries for other databases are kept, and a
// header that does not decode is published as it is, so its consumer reads
// the primary. Unknown stays unknown.
//
// # CDC events
//
// Debezium's envelopes and the commit-safe rule that checks them against
// a replica are in package cdc.
//
// # Migrating a hand-written relay
//
// Stamping decorates an existing publish function; MIGRATING.md gives the
// rollout order (consumers first, then producers, then enforcement) and a
// table of the names this package had before.
package outbox
