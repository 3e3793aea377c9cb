package caughtupkafka

// ScopeName is the instrumentation scope of every instrument and span this
// package creates.
const ScopeName = "github.com/caughtup/caughtup/kafka/caughtupkafka"

// The Consumer counts what it did with each message on
// caughtup.kafka.messages ({message}), by messaging.destination.name (the
// topic the message was read from) and caughtup.kafka.result (handled,
// waited, deferred, retried, dead_lettered, dropped, woken, rerouted): package
// kafka's counter, which caughtupkgo counts on too, so that one dashboard
// covers both Kafka adapters.
