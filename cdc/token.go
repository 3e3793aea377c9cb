package cdc

import (
	"time"

	"github.com/caughtup/caughtup/position"
)

// TransactionToken is the token of a transaction seen in a logical
// replication stream (pgoutput), for a relay or consumer of your own that
// stamps what it forwards, as outbox.LogicalRelay does.
//
// end must be the transaction's end position: pgoutput's
// CommitMessage.TransactionEndLSN, the end of its commit record, which is
// the form pg_last_wal_replay_lsn() has, so replay >= token means the
// transaction is visible on the replica. Never CommitMessage.CommitLSN or
// BeginMessage.FinalLSN: both are where the commit record starts, and a
// replica can have replayed up to there without the commit. epoch is the
// stream's (IDENTIFY_SYSTEM's system identifier and timeline); commitTime
// (CommitMessage.CommitTime, by the primary's clock) becomes the token's
// CapturedAt, which bounds how long consumers wait and defer.
//
// With jackc/pglogrepl:
//
//	func commitToken(epoch position.Epoch, commit *pglogrepl.CommitMessage) position.Token {
//		return cdc.TransactionToken("main", epoch, position.LSN(commit.TransactionEndLSN), commit.CommitTime)
//	}
func TransactionToken(database string, epoch position.Epoch, end position.LSN, commitTime time.Time) position.Token {
	return position.New(database, epoch, end, position.SourceCDC, commitTime)
}
