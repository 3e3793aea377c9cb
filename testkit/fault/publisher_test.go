package fault

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
)

// recorder is a real, in-memory publisher.
type recorder struct {
	mu   sync.Mutex
	got  []int
	fail error
}

func (r *recorder) Publish(_ context.Context, batch []int) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail != nil {
		return r.fail
	}
	r.got = append(r.got, batch...)
	return nil
}

func TestPublisherFaults(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rec := &recorder{}
	p := NewPublisher(rec.Publish)
	select {
	case <-p.Spent():
	default:
		t.Fatal("Spent must be closed while nothing is injected")
	}
	boom := errors.New("boom")
	var did [][]int
	do := func(b []int) { did = append(did, b) }
	p.Inject(
		Fault[int]{At: BeforePublish, Do: do},
		Fault[int]{At: AfterPublish, Do: do, Err: boom},
		Fault[int]{At: AfterPublish, Do: do},
	)
	spent := p.Spent()

	if err := p.Publish(ctx, []int{1}); !errors.Is(err, ErrInjected) {
		t.Fatalf("before publish: %v, want ErrInjected", err)
	}
	if err := p.Publish(ctx, []int{2}); !errors.Is(err, boom) {
		t.Fatalf("after publish: %v, want boom", err)
	}
	// A publish that fails on its own does not spend an AfterPublish fault.
	rec.fail = errors.New("broker down")
	if err := p.Publish(ctx, []int{3}); !errors.Is(err, rec.fail) {
		t.Fatalf("failed publish: %v", err)
	}
	rec.fail = nil
	select {
	case <-spent:
		t.Fatal("Spent closed with a fault still queued")
	default:
	}
	if err := p.Publish(ctx, []int{4}); err != nil {
		t.Fatalf("after publish without Err: %v, want the publisher's nil", err)
	}
	<-spent
	if err := p.Publish(ctx, []int{5}); err != nil {
		t.Fatal(err)
	}
	if want := []int{2, 4, 5}; !slices.Equal(rec.got, want) {
		t.Fatalf("published %v, want %v: a batch failed before publish never reaches the publisher", rec.got, want)
	}
	hit := p.Hit()
	if len(hit) != 3 || hit[0][0] != 1 || hit[1][0] != 2 || hit[2][0] != 4 || len(did) != 3 {
		t.Fatalf("hit %v, did %v", hit, did)
	}
	if p.Calls() != 5 {
		t.Fatalf("calls %d", p.Calls())
	}
}
