package feed_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// deadline bounds every wait for an event: generous, because the machine
// is shared; a healthy run takes milliseconds.
const deadline = 30 * time.Second

var feedSeq atomic.Int64

// feedName is unique per call, so tests sharing one redis-server never
// see each other's messages.
func feedName(t testing.TB) string {
	name := strings.Map(func(r rune) rune {
		if 'a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' {
			return r
		}
		return '-'
	}, t.Name())
	if len(name) > 40 {
		name = name[:40]
	}
	return fmt.Sprintf("%s.%d", name, feedSeq.Add(1))
}

func key(t testing.TB, id string) feed.Key {
	k, err := feed.GenerateKey(id)
	require.NoError(t, err)
	return k
}

// client connects to addr (the shared redis-server when empty).
func client(t testing.TB, opts *redis.Options) *redis.Client {
	t.Helper()
	if opts == nil {
		opts = &redis.Options{}
	}
	if opts.Addr == "" {
		opts.Addr = pgtest.SharedRedis(t).Addr()
	}
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func testContext(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*deadline)
	t.Cleanup(cancel)
	return ctx
}

// metrics collects one MeterProvider's data points.
type metrics struct {
	reader *sdkmetric.ManualReader
	mp     *sdkmetric.MeterProvider
}

func newMetrics(t testing.TB) *metrics {
	r := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return &metrics{reader: r, mp: mp}
}

// sum adds up the int64 points of instrument name whose attributes
// include every one of want.
func (m *metrics) sum(t testing.TB, name string, want ...attribute.KeyValue) int64 {
	t.Helper()
	return metrictest.Sum(t, m.reader, name, want...)
}

func reason(r string) attribute.KeyValue { return attribute.String("caughtup.reason", r) }

// logBuffer is a slog destination tests can read.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// sub runs a Subscriber and turns its callbacks into channels.
type sub struct {
	*feed.Subscriber
	deliveries chan feed.Delivery
	health     chan feed.Health
	metrics    *metrics
	logs       *logBuffer
	overflow   atomic.Bool
}

// startSubscriber fills in Client (the shared redis-server), the
// callbacks, MeterProvider and Logger where cfg leaves them empty, and
// runs the subscriber until the test ends.
func startSubscriber(t testing.TB, cfg feed.SubscriberConfig) *sub {
	t.Helper()
	s := &sub{
		deliveries: make(chan feed.Delivery, 100000),
		health:     make(chan feed.Health, 1000),
		metrics:    newMetrics(t),
		logs:       &logBuffer{},
	}
	if cfg.Client == nil {
		cfg.Client = client(t, nil)
	}
	cfg.MeterProvider = s.metrics.mp
	cfg.Logger = s.logs.logger()
	cfg.OnObservation = func(d feed.Delivery) {
		select {
		case s.deliveries <- d:
		default:
			s.overflow.Store(true)
		}
	}
	cfg.OnHealth = func(h feed.Health) {
		select {
		case s.health <- h:
		default:
			s.overflow.Store(true)
		}
	}
	var err error
	s.Subscriber, err = feed.NewSubscriber(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(deadline):
			t.Error("Subscriber.Run did not return after its context ended")
		}
		require.False(t, s.overflow.Load(), "test channels overflowed")
	})
	return s
}

// waitState reads health changes until st; it fails the test after the
// deadline. It returns the states passed through, st last.
func (s *sub) waitState(t testing.TB, st feed.State) []feed.State {
	t.Helper()
	var seen []feed.State
	timer := time.NewTimer(deadline)
	defer timer.Stop()
	for {
		select {
		case h := <-s.health:
			seen = append(seen, h.State)
			if h.State == st {
				return seen
			}
		case <-timer.C:
			t.Fatalf("subscriber never reached %v; states seen: %v; logs:\n%s", st, seen, s.logs)
		}
	}
}

// next returns the next delivery.
func (s *sub) next(t testing.TB) feed.Delivery {
	t.Helper()
	select {
	case d := <-s.deliveries:
		return d
	case <-time.After(deadline):
		t.Fatalf("no delivery within %v; logs:\n%s", deadline, s.logs)
		return feed.Delivery{}
	}
}

// until reads deliveries up to and including the first that satisfies
// stop, and returns them all.
func (s *sub) until(t testing.TB, stop func(feed.Delivery) bool) []feed.Delivery {
	t.Helper()
	var got []feed.Delivery
	for {
		d := s.next(t)
		got = append(got, d)
		if stop(d) {
			return got
		}
	}
}

// none checks that nothing more was delivered (call after a sentinel).
func (s *sub) none(t testing.TB) {
	t.Helper()
	select {
	case d := <-s.deliveries:
		t.Fatalf("unexpected delivery %+v", d)
	default:
	}
}

func startPublisher(t testing.TB, cfg feed.SenderConfig) (*feed.Sender, *metrics) {
	t.Helper()
	m := newMetrics(t)
	if cfg.Client == nil {
		cfg.Client = client(t, nil)
	}
	cfg.MeterProvider = m.mp
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p, err := feed.NewSender(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p, m
}

func publish(t testing.TB, p *feed.Sender, obs ...feed.Observation) {
	t.Helper()
	for _, o := range obs {
		require.NoError(t, p.Publish(o))
	}
	require.NoError(t, p.Flush(testContext(t)))
}

// blackhole is an address whose TCP handshake completes (the kernel
// queues the connection) but where nothing ever answers.
func blackhole(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l.Addr().String()
}
