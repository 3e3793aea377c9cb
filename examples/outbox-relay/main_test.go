package main

import (
	"bytes"
	"context"
	"testing"
	"time"
)

// TestRun runs the program's logic against throwaway services (a private
// PostgreSQL primary and replica, an in-process Kafka broker) with each
// relay and checks the summary line, which is deterministic: with replay
// paused every event must read the primary, once it streams every event
// reads the replica, and no read is stale.
func TestRun(t *testing.T) {
	for _, relay := range []string{"polling", "logical"} {
		t.Run(relay, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			var out bytes.Buffer
			if err := run(ctx, &out, config{Relay: relay}); err != nil {
				t.Fatal(err)
			}
			want := "outbox-relay: relay=" + relay + " events=20 delivered=20 | replica paused, sticky: replica=0 primary=10 | replica streaming, delayed: replica=10 primary=0 | stale reads=0\n"
			if out.String() != want {
				t.Fatalf("output:\n%s\nwant:\n%s", out.String(), want)
			}
		})
	}
}
