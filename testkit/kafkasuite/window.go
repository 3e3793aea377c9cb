package kafkasuite

import (
	"fmt"
	"maps"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caughtup/caughtup/testkit/latency"
)

// Window times one side of a throughput benchmark over the middle of its
// run: from the first run of the From-th distinct record to that of the
// To-th (10% and 90% of them), so that neither joining the group and
// filling the fetch pipeline nor a tail of partitions finishing one
// after another is measured, only the steady rate. It also takes, at
// both ends, this process's CPU time and the machine's, so that a side's
// cost per record and whether the machine's cores were the bound can be
// read beside its rate. Safe for concurrent use by handlers.
type Window struct {
	seen     []atomic.Bool
	distinct atomic.Int64
	from, to int64
	marks    [2]Mark
	marked   sync.WaitGroup
	all      chan struct{}
	// busy sums Busy's durations: the handlers' time in their work,
	// whose ratio to the window's length is how many ran at once.
	busy atomic.Int64
	// replicas counts the records read on each replica (Replica).
	mu       sync.Mutex
	replicas map[string]int64
}

// Mark is a Window's end: when, and the CPU time this process and the
// whole machine had used by then.
type Mark struct {
	At      time.Time
	CPU     time.Duration
	Machine time.Duration
}

func mark() Mark { return Mark{At: time.Now(), CPU: ProcessCPUTime(), Machine: MachineCPUTime()} }

// NewWindow returns the Window of a run over n records, numbered 0 to
// n-1.
func NewWindow(n int) *Window {
	w := &Window{seen: make([]atomic.Bool, n), all: make(chan struct{}), from: int64(n) / 10, to: int64(n) * 9 / 10,
		replicas: map[string]int64{}}
	w.marked.Add(len(w.marks))
	return w
}

// See notes that record i ran; an i out of range is an error.
func (w *Window) See(i int) error {
	if i < 0 || i >= len(w.seen) {
		return fmt.Errorf("not a throughput record: %d", i)
	}
	if w.seen[i].Swap(true) {
		return nil
	}
	switch n := w.distinct.Add(1); n {
	case w.from:
		w.marks[0] = mark()
		w.marked.Done()
	case w.to:
		w.marks[1] = mark()
		w.marked.Done()
	}
	if w.distinct.Load() == int64(len(w.seen)) {
		select {
		case <-w.all:
		default:
			close(w.all)
		}
	}
	return nil
}

// Busy adds d to the handlers' time in their work.
func (w *Window) Busy(d time.Duration) { w.busy.Add(int64(d)) }

// Replica notes a record read on the replica named name.
func (w *Window) Replica(name string) {
	w.mu.Lock()
	w.replicas[name]++
	w.mu.Unlock()
}

// Result is a side's figures over its window.
type Result struct {
	// Rate is records per second.
	Rate float64
	// CPU is this process's CPU time per record, Machine the machine's
	// (every process: the broker, the database servers), and Busy the
	// machine's CPU time over its cores' capacity in the window: near 1,
	// the cores are the bound.
	CPU, Machine time.Duration
	Busy         float64
	// InFlight is how many handlers were in their work at once, on
	// average (for sides that report Busy).
	InFlight float64
	// Replicas is each replica's share of the records read on replicas.
	Replicas map[string]float64
}

// Wait waits until every record ran (failing t after timeout) and returns
// the window's figures.
func (w *Window) Wait(t testing.TB, timeout time.Duration) Result {
	t.Helper()
	select {
	case <-w.all:
	case <-time.After(timeout):
		t.Fatalf("only %d of %d records within %s", w.distinct.Load(), len(w.seen), timeout)
	}
	w.marked.Wait()
	n := w.to - w.from
	wall := w.marks[1].At.Sub(w.marks[0].At)
	machine := w.marks[1].Machine - w.marks[0].Machine
	r := Result{
		Rate:     float64(n) / wall.Seconds(),
		CPU:      (w.marks[1].CPU - w.marks[0].CPU) / time.Duration(n),
		Machine:  machine / time.Duration(n),
		Busy:     float64(machine) / float64(wall) / float64(runtime.NumCPU()),
		InFlight: float64(w.busy.Load()) * float64(n) / float64(len(w.seen)) / float64(wall),
		Replicas: map[string]float64{},
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	total := int64(0)
	for _, c := range w.replicas {
		total += c
	}
	for name, c := range w.replicas {
		r.Replicas[name] = float64(c) / float64(total)
	}
	return r
}

// Spread is rs' replica shares, the median share of each replica over
// the rounds, as "name 50% / name 50%".
func Spread(rs []Result) string {
	names := map[string]bool{}
	for _, r := range rs {
		for n := range r.Replicas {
			names[n] = true
		}
	}
	s := ""
	for _, n := range slices.Sorted(maps.Keys(names)) {
		shares := make([]float64, len(rs))
		for i, r := range rs {
			shares[i] = r.Replicas[n]
		}
		if s != "" {
			s += " / "
		}
		s += fmt.Sprintf("%s %.0f%%", n, 100*latency.Percentile(shares, 0.5))
	}
	if s == "" {
		return "-"
	}
	return s
}

// Spread3 is the median, smallest and largest of xs, as "m (lo–hi)" with
// format f for each.
func Spread3(f string, xs []float64) string {
	if len(xs) == 0 {
		return "-"
	}
	return fmt.Sprintf(f+" ("+f+"–"+f+")", latency.Percentile(xs, 0.5), slices.Min(xs), slices.Max(xs))
}
