// Package kafka is what caughtup's two Kafka adapters share:
// caughtupkafka (kafka-go) and caughtupkgo (franz-go) are thin layers over
// their client libraries, and this package is the rest. It holds the wire
// format of the records they republish to retry and dead-letter topics,
// so that a retry topic written by one is read correctly by the other,
// the reading of a record's token and trace headers, and the
// caughtup.kafka.messages counter, so that one dashboard covers both. It
// works on either client's header type (kafka.Header, kgo.RecordHeader),
// which have the same fields.
//
// Applications use an adapter; they need not import this package.
package kafka
