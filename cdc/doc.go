// Package cdc decides when a change-data-capture event may be read on a
// PostgreSQL read replica.
//
// A CDC event carries a log position of its own, but which one matters:
// pg_last_wal_replay_lsn() on a replica is the end of the last replayed
// record, so replay >= position proves the event's transaction visible
// only when the position is the end of its commit record.
//
//   - A logical replication stream (pgoutput) gives that position exactly:
//     CommitMessage.TransactionEndLSN. TransactionToken turns it into an
//     ordinary caughtup token that consumers compare like any job's; the
//     outbox package's LogicalRelay stamps with it.
//   - Debezium does not. Its source.lsn is the position of the change
//     record, before the commit, and its sequence[0] is the previous
//     transaction's commit. ParseDebezium reads the envelope and Checker
//     applies a commit-safe rule on the replica instead: replay >=
//     source.lsn, and pg_xact_status of the event's transaction (its
//     32-bit txId widened with WidenXID) reported 'committed' by the
//     standby itself.
//
// Anything the Checker cannot vouch for (malformed JSON, another
// connector, no lsn or txId, snapshot reads, a server that is not a
// standby, a replica that does not answer) comes back as StatusUnknown
// with a Reason, counted in caughtup.cdc.primary: read the primary.
// Unknown is never fresh.
//
//	// Once, at start: checker, err := cdc.NewChecker(cdc.Config{}).
//	// Then per message, on the replica the consumer would read:
//	func poolFor(ctx context.Context, checker *cdc.Checker, replica, primary *pgxpool.Pool, envelope []byte) (*pgxpool.Pool, error) {
//		_, res := checker.CheckEnvelope(ctx, replica, envelope)
//		switch res.Status {
//		case cdc.StatusFresh:
//			return replica, nil
//		case cdc.StatusNotYet:
//			return nil, errNotYet // wait and check again, defer, or read the primary
//		default: // cdc.StatusUnknown: res.Reason says why
//			return primary, nil
//		}
//	}
//
//	var errNotYet = errors.New("the change is not on the replica yet")
//
// Check takes an already parsed Source and any replica Querier (a pool,
// a connection, a transaction); it runs at most two read-only queries and
// has no side effect besides its counters, so a consumer can call it on
// whichever replica its router chose. The Kafka adapter does exactly that
// for Debezium topics (caughtupkafka.TokenDebezium): ParseEnvelope
// once per message, then Check on each replica the router picks, through
// consume.Job.Verify, so that a replica where the transaction
// is not committed yet counts as behind and the message waits, is
// deferred or reads the primary like any other.
package cdc
