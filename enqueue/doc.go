// Package enqueue is caughtup's producer side: it reads the primary's WAL
// position right after a transaction commits, turns it into a
// position.Token, and carries that token in the context until a queue
// adapter stamps it on the job or event.
//
//	func signUp(ctx context.Context, pool *pgxpool.Pool, client *caughtupasynq.Client, email string) error {
//		ctx, err := enqueue.InTx(ctx, pool, func(tx pgx.Tx) error {
//			_, err := tx.Exec(ctx, "INSERT INTO users (email) VALUES ($1)", email)
//			return err
//		})
//		if err != nil {
//			return err // an *enqueue.CaptureError whose Committed is true: committed, no token
//		}
//		task := caughtupasynq.NewTask(ctx, "email:welcome", []byte(email))
//		_, err = client.EnqueueContext(ctx, task) // the adapter adds TokenFrom(ctx)
//		return err
//	}
//
// or, with a transaction the code already manages:
//
//	func rename(ctx context.Context, conn *pgx.Conn, id int64, name string) (context.Context, error) {
//		tx, err := conn.Begin(ctx) // conn: *pgx.Conn or an acquired *pgxpool.Conn
//		if err != nil {
//			return ctx, err
//		}
//		defer tx.Rollback(ctx) // after Commit, a no-op
//		if _, err := tx.Exec(ctx, "UPDATE users SET name = $1 WHERE id = $2", name, id); err != nil {
//			return ctx, err
//		}
//		return enqueue.Commit(ctx, tx) // COMMIT, then read the position
//	}
//
// # Which position
//
// The token holds pg_current_wal_insert_lsn() read after COMMIT has returned,
// on the connection that committed. Earlier is wrong: a position read inside
// the transaction is below its own commit record, so a replica can replay
// past it while the row is still invisible there. pg_current_wal_lsn() is
// wrong too: it is the write position, which with synchronous_commit = off
// can be below the commit record when COMMIT returns. The insert position
// read afterwards is at or past the end of the commit record, and
// pg_last_wal_replay_lsn() on a replica is an end position as well, so
// replay >= token means the replica shows the write. One correction is
// applied: when the insert position sits just past a WAL page header (the
// last record ended at a page boundary, or a WAL switch ended the segment)
// the token is the boundary, which is where a replica's replay stops;
// otherwise a quiet primary's replicas would not reach the token until the
// next WAL record.
//
// The epoch (system identifier and timeline) is read with it: the timeline
// in the same query every time, the system identifier once per connection
// and Config.SystemIDRefresh. One round trip follows the commit.
//
// Code that read from a replica and enqueues work based on what it read
// stamps ReplicaRead's token (the replica's replay position), so the job
// does not run on a replica that is further behind than that read.
//
// # Several writes, several databases
//
// Tokens in the context merge: for each logical database the furthest
// position, with the oldest capture time. An application with several
// databases makes one Capturer per logical database (Config.Database); their
// tokens merge into one. WithSession makes the merge survive code that does
// not hand the returned context back to its caller.
//
// # Tokens computed when asked for
//
// A TokenSource supplies its token only when TokenFrom first needs it:
// consume.Router.Route gives each handler the job's token raised to what
// the replicas it read had replayed, which only handlers that enqueue look
// at. WithTokenSource adds one to a context; SourceContext carries one in
// a context type of an adapter's own, for adapters that make a context
// per job at a high rate and would rather not allocate twice.
//
// Consumers must still tolerate "row not found": an asynchronously committed
// write that a crash loses on the same timeline can have its position
// reused, and no token can tell.
package enqueue
