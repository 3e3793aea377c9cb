package fault

import (
	"context"
	"sync"

	kafkago "github.com/segmentio/kafka-go"
)

// MessageWriter is what a kafka-go Writer offers and what caughtup's kafka
// adapter writes through (caughtupkafka.MessageWriter has the same method
// set, so a *Writer can be given wherever it asks for one).
type MessageWriter interface {
	WriteMessages(ctx context.Context, msgs ...kafkago.Message) error
}

var _ MessageWriter = (*Writer)(nil)

// Writer wraps a real Kafka writer and injects faults around its writes,
// as Dialer does around connections: the messages always go to the real
// broker, or nowhere. It is safe for concurrent use.
//
//	fw := fault.NewWriter(kafkaWriter)
//	fw.AfterWrite(func(ctx context.Context, msgs []kafkago.Message) {
//		dialer.Refuse(true) // the process dies right after the broker
//		dialer.Cut()        // acknowledged the write, before it commits
//	})
//	fw.Hold()         // writes reach the broker, but the caller hangs
//	fw.Fail(errBoom)  // writes fail without reaching the broker
type Writer struct {
	next MessageWriter

	mu      sync.Mutex
	fail    error
	after   func(ctx context.Context, msgs []kafkago.Message)
	held    chan struct{} // closed on Release; nil while not holding
	written int
	holding int
}

// NewWriter returns a Writer that writes through next.
func NewWriter(next MessageWriter) *Writer { return &Writer{next: next} }

// WriteMessages writes msgs through the wrapped writer unless the Writer is
// failing (then it returns that error and writes nothing). After a write
// the broker acknowledged it calls the AfterWrite function, then, while
// the Writer holds, keeps the caller waiting until Release or until ctx
// ends; in the second case it returns ctx's error although the messages
// were written, as a process that froze or died after the write would
// never learn that it succeeded.
func (w *Writer) WriteMessages(ctx context.Context, msgs ...kafkago.Message) error {
	w.mu.Lock()
	fail := w.fail
	w.mu.Unlock()
	if fail != nil {
		return fail
	}
	if err := w.next.WriteMessages(ctx, msgs...); err != nil {
		return err
	}
	w.mu.Lock()
	w.written++
	after := w.after
	w.mu.Unlock()
	if after != nil {
		after(ctx, msgs)
	}
	// Read after the hook, so that a hook may call Hold for this write.
	w.mu.Lock()
	held := w.held
	if held != nil {
		w.holding++
	}
	w.mu.Unlock()
	if held == nil {
		return nil
	}
	defer func() {
		w.mu.Lock()
		w.holding--
		w.mu.Unlock()
	}()
	select {
	case <-held:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Fail makes writes return err without reaching the broker; nil makes
// them work again.
func (w *Writer) Fail(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.fail = err
}

// AfterWrite sets a function called after every write the broker
// acknowledged, before WriteMessages returns (nil removes it). It runs on
// the writing goroutine, so whatever it does happens before the caller
// learns that the write succeeded.
func (w *Writer) AfterWrite(f func(ctx context.Context, msgs []kafkago.Message)) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.after = f
}

// Hold makes writes that reach the broker from now on keep their caller
// waiting until Release or until the caller's context ends.
func (w *Writer) Hold() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.held == nil {
		w.held = make(chan struct{})
	}
}

// Release lets held writes return (successfully) and stops holding.
func (w *Writer) Release() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.held != nil {
		close(w.held)
		w.held = nil
	}
}

// Stats reports the writes the broker acknowledged so far and the callers
// being held right now.
func (w *Writer) Stats() (written, holding int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.written, w.holding
}
