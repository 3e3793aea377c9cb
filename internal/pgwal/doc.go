// Package pgwal is the one place that knows how to read WAL positions and
// epochs from PostgreSQL: the SQL, the column order, the scanning and the
// parsing. enqueue's captures, replay's tracker, replicapool's connection
// checks and caughtup doctor use it; relays and CDC checkers that read a
// replay position should too, rather than writing the query again.
//
// Every query runs in the simple protocol: one round trip, no prepared
// statement (so it also works through transaction-pooling proxies), text
// results parsed here exactly. Times come back as microseconds since the
// Unix epoch, so neither DateStyle nor TimeZone can change their reading.
//
//	func positions(ctx context.Context, conn *pgx.Conn, replicaPool *pgxpool.Pool) error {
//		p, err := pgwal.ReadPrimary(ctx, conn, pgwal.Control) // after COMMIT, on the writing connection
//		if err != nil {
//			return err // errors.Is(err, pgwal.ErrInRecovery) on a standby
//		}
//		epoch, end := p.Epoch(), p.InsertEnd()
//
//		r, err := pgwal.ReadReplica(ctx, replicaPool, pgwal.Control|pgwal.Status)
//		if err != nil {
//			return err
//		}
//		fmt.Println(epoch, end, r.InRecovery, r.Replayed(), r.PostmasterStart)
//		return nil
//	}
//
// The facts the queries rely on (design notes, "PostgreSQL facts"):
//
//   - The primary's position is pg_current_wal_insert_lsn(), read after
//     COMMIT has returned: at or past the end of the commit record, unlike
//     pg_current_wal_lsn() (the write position) with synchronous_commit =
//     off. Primary.InsertEnd moves a position just past a page header back
//     to the page boundary, where replay positions are.
//   - The primary's timeline is the first 8 hex digits of
//     pg_walfile_name(pg_current_wal_lsn()), exact right after a promotion;
//     pg_control_checkpoint().timeline_id lags it until the next checkpoint.
//     pg_walfile_name errors during recovery (ErrInRecovery).
//   - A standby's timeline is pg_stat_wal_receiver.received_tli, shown only
//     to roles with pg_read_all_stats, and only while a WAL receiver runs.
//   - pg_last_wal_replay_lsn() is the end of the last replayed record, so
//     replay >= token is right for end positions.
//   - A standby that restarts (or whose postmaster reinitializes after a
//     backend crash) replays again from its last restartpoint and accepts
//     connections at its minimum recovery point, which can be below what it
//     had replayed. Replica.PostmasterStart and RecoveryStart name the run of recovery a reading
//     belongs to, so that a consumer can tell a restart from progress.
package pgwal
