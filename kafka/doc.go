// Package kafka is the engine both of caughtup's Kafka adapters run:
// caughtupkafka (kafka-go) and caughtupkgo (franz-go) own their client's
// consumer group, fetching and commits, and hand every assigned partition
// to an Engine, which processes its records one at a time, in offset
// order:
//
//   - each record's token is read once (its position.HeaderName headers,
//     or the adapter's Adapter.Token) and routed (consume.Tally.Route)
//     before the handler runs with the routed context;
//   - a record no replica can serve yet is held at the head of its
//     partition (InPlace, the partition's Source paused) or republished
//     to a retry topic with a due time (RetryTopic); a deferral for lag
//     ends early when a replica passes the token;
//   - a handler error is retried up to Config.MaxAttempts, then the record
//     goes to the dead-letter topic or hook; deferrals never count, nor do
//     failures of a replica the router chose (consume.ReplicaFailed);
//   - a record is done once handled, republished or dead-lettered, and
//     only done offsets are committed (Committer), so delivery is
//     at-least-once.
//
// The retry and dead-letter headers (HeaderDue and the rest) are the
// same for both adapters, so that a retry topic written by one is read
// correctly by the other, and so are the caughtup.kafka.messages counter
// and the consume.SpanDefer and consume.SpanWake spans: one dashboard
// covers both.
//
// Applications use an adapter and need not import this package. An
// adapter for another client implements Client (reading a record's
// place and headers, producing) and Source (a partition's records, pause
// and resume), and drives the Engine:
//
//	import (
//		"context"
//
//		"github.com/caughtup/caughtup/kafka"
//	)
//
//	// An adapter for a client whose records are R and headers H, with the
//	// client's side of the engine (Client, Source, Committer) written for it:
//	func consume[R any, H kafka.Header](ctx context.Context, cfg kafka.Config[R], client kafka.Client[R, H],
//		handler func(context.Context, R) error, src kafka.Source[R], commit kafka.Committer) error {
//		eng, err := kafka.New(cfg, kafka.Adapter[R, H]{
//			Name: "caughtup/mykafka", Scope: "example.com/mykafka", Client: client, Handler: handler,
//		})
//		if err != nil {
//			return err
//		}
//		// For each assigned partition:
//		p := eng.NewPartition("user-events", 0, src)
//		done := make(chan struct{})
//		go func() {
//			defer close(done)
//			p.Run(ctx)
//		}()
//		// Every CommitInterval, and when partitions are revoked:
//		eng.Commit(ctx, []*kafka.Partition[R, H]{p}, commit)
//		<-done
//		return nil
//	}
//
// It works on either client's header type (kafka.Header,
// kgo.RecordHeader), which have the same fields (Header).
package kafka
