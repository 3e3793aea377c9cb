// Command resolve downloads the Kafka, Kafka Connect and Debezium jars that
// testkit/kafkatest runs into its cache, so that the first test run does
// not pay for it. scripts/install-deps runs it; it is quick when the cache
// is complete.
//
//	go run ./testkit/kafkatest/cmd/resolve
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/caughtup/caughtup/testkit/kafkatest"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	began := time.Now()
	art, err := kafkatest.Resolve(ctx, func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("kafkatest: jars in %s (%v)\n", art.Dir, time.Since(began).Round(time.Millisecond))
}
