package caughtupkgo

// ScopeName is the instrumentation scope of every instrument and span this
// package creates.
const ScopeName = "github.com/caughtup/caughtup/kafka/caughtupkgo"

// The Consumer counts what it did with each record on
// caughtup.kafka.messages, package kafka's counter, caughtupkafka's too, so
// that one dashboard and one alert cover both Kafka adapters. Each
// partition's worker counts in bulk and the counts reach the instrument at
// every commit.
