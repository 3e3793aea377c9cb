package kafkasuite

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/testkit/kafkatest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// Main runs an adapter's tests with the shared PostgreSQL cluster and
// Kafka broker, stopped afterwards, and checks for leaked goroutines:
//
//	func TestMain(m *testing.M) { kafkasuite.Main(m) }
func Main(m *testing.M) {
	goleak.VerifyTestMain(kafkatest.Wrap(pgtest.Wrap(m, pgtest.Options{}), kafkatest.Options{
		// Kafka refuses session timeouts under 6s by default; the kill
		// and rebalance tests let a dead member's partitions move on
		// within 2s.
		Settings: map[string]string{"group.min.session.timeout.ms": "1000"},
	}))
}

// Running is a consumer's Run on a goroutine of its own, until Stop or
// the end of the test.
type Running struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

// Start calls run (a Consumer's Run) with a context that Stop cancels;
// the test's cleanup stops it and fails the test if Run returned an error.
func Start(t testing.TB, run func(context.Context) error) *Running {
	r := &Running{done: make(chan error, 1)}
	var ctx context.Context
	ctx, r.cancel = context.WithCancel(context.Background())
	go func() { r.done <- run(ctx) }()
	t.Cleanup(func() {
		if err := r.Stop(); err != nil {
			t.Error(err)
		}
	})
	return r
}

// Stop cancels the Run and waits for it to return, at most 30s; it
// returns Run's error. Later calls return the same.
func (r *Running) Stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(30 * time.Second):
			r.err = fmt.Errorf("the consumer did not stop within 30s")
		}
	})
	return r.err
}
