// Package position holds caughtup's value types: WAL positions (LSN),
// the history they belong to (Epoch, History), and the Token a job carries
// from the producer that wrote to the consumer that reads.
//
// It depends only on the standard library so that every other package,
// and users' own code, can import it.
//
//	func caughtUp(sys uint64, replicaEpoch position.Epoch, replay position.LSN, history position.History) (bool, error) {
//		tok := position.New("main", position.Epoch{SystemID: sys, Timeline: 1},
//			position.MustParseLSN("0/16B3740"), position.SourcePrimary, time.Now())
//		header, err := tok.Encode() // "v1;...;main=p.<sys>.1.0/16B3740"
//		if err != nil {
//			return false, err
//		}
//		back, err := position.Decode(header) // typed errors, never panics
//		if err != nil {
//			return false, err
//		}
//		entry, ok := back.Entry("main")
//		if !ok {
//			return true, nil // nothing written to main: any replica will do
//		}
//		switch entry.Compare(position.Replayed{Epoch: replicaEpoch, LSN: replay}, history).Status {
//		case position.CaughtUp: // read the replica
//			return true, nil
//		case position.Behind: // wait, defer or use the primary
//		case position.NotComparable: // another history: use the primary
//		}
//		return false, nil
//	}
package position
