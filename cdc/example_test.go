package cdc_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/caughtup/caughtup/cdc"
	"github.com/caughtup/caughtup/position"
)

// A consumer of Debezium events parses each envelope and asks a
// Checker about the replica it would read (checker.CheckEnvelope(ctx,
// replicaPool, value)); envelopes with no commit-safe rule never reach a
// replica and go to the primary with a reason.
func ExampleParseDebezium() {
	for _, value := range []string{
		`{"schema":{},"payload":{"op":"c","after":{"id":1},"source":{"connector":"postgresql","lsn":24023184,"txId":747}}}`,
		`{"op":"r","source":{"connector":"postgresql","lsn":24023184,"txId":747,"snapshot":"true"}}`,
		`{"op":"c","source":{"connector":"mysql","pos":154}}`,
		`{"op":"c","source":{"connector":"postgresql","txId":747}}`,
		`{"schema":{},"payload":null}`,
	} {
		ev, err := cdc.ParseDebezium([]byte(value))
		if err == nil {
			err = ev.Validate()
		}
		var cerr *cdc.EnvelopeError
		switch {
		case err == nil:
			fmt.Printf("check on the replica: lsn %s, txId %d\n", ev.Source.LSN, ev.Source.TxID)
		case errors.As(err, &cerr):
			fmt.Printf("primary (%s): malformed=%v\n", cerr.Reason, errors.Is(err, cdc.ErrMalformedEnvelope))
		}
	}
	// Output:
	// check on the replica: lsn 0/16E9090, txId 747
	// primary (snapshot): malformed=false
	// primary (not_postgresql): malformed=false
	// primary (missing_lsn): malformed=false
	// primary (malformed): malformed=true
}

// Debezium reports 32-bit transaction IDs; pg_xact_status wants the
// epoch too. WidenXID places the ID next to a standby's horizon, across a
// wraparound in either direction.
func ExampleWidenXID() {
	horizon := uint64(3)<<32 | 0xFFFFFF00 // epoch 3, just before a wraparound
	for _, txid := range []uint64{0xFFFFFE00, 0x00000010} {
		xid8, _ := cdc.WidenXID(txid, horizon)
		fmt.Printf("txId %#x -> epoch %d, xid %#x\n", txid, xid8>>32, xid8&0xFFFFFFFF)
	}
	// Output:
	// txId 0xfffffe00 -> epoch 3, xid 0xfffffe00
	// txId 0x10 -> epoch 4, xid 0x10
}

// A relay or consumer of a pgoutput stream stamps what it forwards with
// the transaction's end position (CommitMessage.TransactionEndLSN), an
// ordinary token that consumers compare like any job's.
func ExampleTransactionToken() {
	epoch := position.Epoch{SystemID: 7301234567890123456, Timeline: 1}
	end := position.MustParseLSN("0/16B3740") // commit.TransactionEndLSN
	tok := cdc.TransactionToken("main", epoch, end, time.UnixMilli(1700000000000))
	e, _ := tok.Entry("main")
	fmt.Println(e.Database, e.LSN, e.Source, e.Epoch.Timeline)
	// Output: main 0/16B3740 cdc 1
}
