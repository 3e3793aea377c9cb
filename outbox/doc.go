// Package outbox is caughtup's transactional outbox: a table the producer
// writes events into inside its business transaction, two relays that
// publish them stamped with a token, and freshness checks for CDC events.
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
//     transaction's exact end position, CommitMessage.TransactionEndLSN.
//
// Both publish through a Publisher (KafkaPublisher, AsynqPublisher, or
// your own) and mark rows done only after the publish was acknowledged, so
// delivery is at least once: consumers dedupe on HeaderEventID. The token
// travels in position.HeaderName as an ordinary caughtup token
// (TokenFromHeaders), so consumers compare it as they compare any job's.
//
//	// Once, at startup or in a migration:
//	err := outbox.Migrate(ctx, pool)
//
//	// In the business transaction:
//	tx, _ := pool.Begin(ctx)
//	_, _ = tx.Exec(ctx, "UPDATE accounts SET ...")
//	id, err := outbox.Insert(ctx, tx, outbox.Event{Topic: "account.updated", Key: key, Payload: body})
//	err = tx.Commit(ctx)
//
//	// In the relay process:
//	pub, _ := outbox.NewKafkaPublisher(&kafka.Writer{Addr: kafka.TCP(brokers...),
//		Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll})
//	relay, _ := outbox.NewPollingRelay(outbox.PollingConfig{DB: pool, Publisher: pub})
//	go relay.Run(ctx)
//
// # CDC events
//
// A pgoutput consumer of your own stamps as LogicalRelay does, with
// CDCToken: the transaction's TransactionEndLSN. Debezium's source.lsn is
// the position of the change, not of its commit, and is no token.
// CDCChecker applies a commit-safe rule instead: replay past the change,
// and the transaction reported committed by the standby itself
// (pg_xact_status). Envelopes it cannot vouch for (malformed, not
// PostgreSQL, no lsn or txId, snapshot reads) come back as CDCUnknown with
// a reason, counted, for the primary.
//
// # Migrating a hand-written relay
//
// Stamp decorates an existing publish function; MIGRATING.md gives the
// rollout order (consumers first, then producers, then enforcement).
package outbox
