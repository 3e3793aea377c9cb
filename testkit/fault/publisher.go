package fault

import (
	"context"
	"errors"
	"slices"
	"sync"
)

// ErrInjected is what a Publisher call returns for a fault without an Err
// of its own.
var ErrInjected = errors.New("fault: injected publish failure")

// Point says where around a publish a Fault lands.
type Point uint8

const (
	// BeforePublish: the batch never reaches the wrapped publisher, as
	// when the process dies, or the broker is unreachable, after the
	// batch was claimed or received.
	BeforePublish Point = iota
	// AfterPublish: the wrapped publisher has published the batch (the
	// broker acknowledged it) and the fault lands before the caller
	// learns so, as when the process dies between the acknowledgement and
	// marking or confirming the batch.
	AfterPublish
)

// Fault is one injected failure of a Publisher call.
type Fault[E any] struct {
	At Point
	// Do runs at the fault's point, with the batch, before the call
	// returns: Dialer.Cut to drop the caller's connections without a
	// goodbye, terminating its database session, cancelling its context.
	Do func(batch []E)
	// Err is what the call returns. Nil means ErrInjected at
	// BeforePublish (a batch that was not published never reports
	// success) and the wrapped publisher's own nil at AfterPublish: the
	// caller carries on into whatever Do broke.
	Err error
}

// Publisher wraps a real batch publisher (an outbox.Publisher's Publish
// method, a broker client) and injects queued faults into its calls, in
// the manner of Dialer for connections: the batches that get through go
// to the real thing. E is the event type, so that *Publisher[outbox.Event]
// is an outbox.Publisher without this package importing outbox. It is
// safe for concurrent use.
//
//	fp := fault.NewPublisher(pub.Publish)
//	fp.Inject(fault.Fault[outbox.Event]{At: fault.AfterPublish, Do: func([]outbox.Event) { dialer.Cut() }, Err: errCrash})
//	relay, _ := outbox.NewPollingRelay(outbox.PollingConfig{Primary: pool, Publisher: fp})
type Publisher[E any] struct {
	next func(ctx context.Context, batch []E) error

	mu       sync.Mutex
	queue    []Fault[E]
	inflight int // faults taken from queue that have not landed yet
	hit      [][]E
	calls    int
	spent    chan struct{} // closed while no fault is queued or in flight
}

// NewPublisher wraps next.
func NewPublisher[E any](next func(ctx context.Context, batch []E) error) *Publisher[E] {
	spent := make(chan struct{})
	close(spent)
	return &Publisher[E]{next: next, spent: spent}
}

// Inject queues faults: each following call meets the next queued fault,
// until none is left; calls after that go straight through.
func (p *Publisher[E]) Inject(faults ...Fault[E]) {
	if len(faults) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.queue) == 0 && p.inflight == 0 {
		p.spent = make(chan struct{})
	}
	p.queue = append(p.queue, faults...)
}

// Publish publishes batch through the wrapped publisher, unless the call
// meets a fault.
func (p *Publisher[E]) Publish(ctx context.Context, batch []E) error {
	p.mu.Lock()
	p.calls++
	var f Fault[E]
	faulty := len(p.queue) > 0
	if faulty {
		f = p.queue[0]
		p.queue = p.queue[1:]
		p.inflight++
	}
	p.mu.Unlock()
	if !faulty {
		return p.next(ctx, batch)
	}
	var err error
	if f.At == AfterPublish {
		if err = p.next(ctx, batch); err != nil {
			// The publish itself failed: the fault did not land where it
			// was meant to, so it stays queued for the next call.
			p.requeue(f)
			return err
		}
	} else if f.Err == nil {
		f.Err = ErrInjected
	}
	if f.Do != nil {
		f.Do(batch)
	}
	if f.Err != nil {
		err = f.Err
	}
	p.mu.Lock()
	p.hit = append(p.hit, slices.Clone(batch))
	p.inflight--
	if len(p.queue) == 0 && p.inflight == 0 {
		close(p.spent)
	}
	p.mu.Unlock()
	return err
}

func (p *Publisher[E]) requeue(f Fault[E]) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.inflight--
	p.queue = append([]Fault[E]{f}, p.queue...)
}

// Hit returns copies of the batches that met a fault, in order.
func (p *Publisher[E]) Hit() [][]E {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.hit)
}

// Spent is closed once every fault injected so far has landed (at once
// when none is queued): wait on it before looking at what a fault did.
func (p *Publisher[E]) Spent() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.spent
}

// Calls is how many times Publish was called.
func (p *Publisher[E]) Calls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}
