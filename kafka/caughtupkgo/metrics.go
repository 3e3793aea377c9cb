package caughtupkgo

// ScopeName is the instrumentation scope of every instrument and span this
// package creates.
const ScopeName = "github.com/caughtup/caughtup/kafka/caughtupkgo"

// The Consumer counts what it did with each record on
// caughtup.kafka.messages, the instrument, attributes and values of
// caughtupkafka's (package kafka), so that one dashboard and one alert
// cover both Kafka adapters. Each partition's worker counts in bulk
// (kafka.Counts) and the counts reach the instrument at every commit.
