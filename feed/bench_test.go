package feed_test

import (
	"testing"
	"time"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/latency"
)

// BenchmarkPublishDeliver measures Publish → OnObservation on loopback
// through a real redis-server, one observation in flight at a time:
// ns/op is the mean; p50 and p99 are reported as extra metrics. The
// signed and unsigned variants show what the signature adds.
func BenchmarkPublishDeliver(b *testing.B) {
	for _, signed := range []bool{true, false} {
		b.Run(map[bool]string{false: "unsigned", true: "signed"}[signed], func(b *testing.B) {
			name := feedName(b)
			var ring feed.Keyring
			if signed {
				ring.Keys = []feed.Key{key(b, "k1")}
			}
			s := startSubscriber(b, feed.SubscriberConfig{Feed: name, Keys: ring, Insecure: !signed})
			s.waitState(b, feed.StateSubscribed)
			p, _ := startPublisher(b, feed.SenderConfig{Feed: name, Name: "bench", Keys: ring, Insecure: !signed})
			lat := make([]time.Duration, 0, b.N)
			o := replica("r1", 0)
			b.ResetTimer()
			for i := range b.N {
				o.Replica.Replayed = position.LSN(i + 1)
				start := time.Now()
				o.PolledAt = start
				if err := p.Publish(o); err != nil {
					b.Fatal(err)
				}
				d := s.next(b)
				lat = append(lat, time.Since(start))
				if d.Replica.Replayed != o.Replica.Replayed {
					b.Fatalf("got %v, want %v", d.Replica.Replayed, o.Replica.Replayed)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(latency.Percentile(lat, 0.5).Microseconds()), "p50-µs")
			b.ReportMetric(float64(latency.Percentile(lat, 0.99).Microseconds()), "p99-µs")
		})
	}
}
