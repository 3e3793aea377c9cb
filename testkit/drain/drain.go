// Package drain holds what the adapters' drain benchmarks share: the sizes
// and rounds they run (CAUGHTUP_DRAIN_N, CAUGHTUP_DRAIN_ROUNDS), the order
// of a round's sides, the first
// handler start of each job, and the median of the rounds' ratios.
package drain

import (
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Sizes is CAUGHTUP_DRAIN_N (comma-separated), default 1000,5000,10000.
func Sizes(tb testing.TB) []int {
	s := os.Getenv("CAUGHTUP_DRAIN_N")
	if s == "" {
		return []int{1000, 5000, 10000}
	}
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			tb.Fatalf("CAUGHTUP_DRAIN_N: %q is not a positive count", f)
		}
		out = append(out, n)
	}
	return out
}

// Rounds is CAUGHTUP_DRAIN_ROUNDS, default 3.
func Rounds(tb testing.TB) int {
	if s := os.Getenv("CAUGHTUP_DRAIN_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			tb.Fatalf("CAUGHTUP_DRAIN_ROUNDS: %q is not a positive count", s)
		}
		return n
	}
	return 3
}

// RunSides runs the sides of round r one after the other, starting with
// side r mod len(sides), so that over the rounds each side runs first,
// second and last as often, and none always gets the machine fresh.
func RunSides(r int, sides ...func()) {
	for i := range sides {
		sides[(i+r)%len(sides)]()
	}
}

// Median is the median of s (NaN for none), s left as it is.
func Median(s []float64) float64 {
	c := slices.Clone(s)
	slices.Sort(c)
	if len(c) == 0 {
		return math.NaN()
	}
	if len(c)%2 == 1 {
		return c[len(c)/2]
	}
	return (c[len(c)/2-1] + c[len(c)/2]) / 2
}

// Starts records each job's first handler start, by index.
type Starts struct {
	at   []atomic.Int64 // UnixNano, 0 until started
	left atomic.Int64
	all  chan struct{}
}

// NewStarts is Starts for jobs 0..n-1.
func NewStarts(n int) *Starts {
	s := &Starts{at: make([]atomic.Int64, n), all: make(chan struct{})}
	s.left.Store(int64(n))
	return s
}

// Start records job i's start at at; it reports whether it was the job's
// first (an index out of range is not a job of this drain).
func (s *Starts) Start(i int, at time.Time) bool {
	if i < 0 || i >= len(s.at) || !s.at[i].CompareAndSwap(0, at.UnixNano()) {
		return false
	}
	if s.left.Add(-1) == 0 {
		close(s.all)
	}
	return true
}

// Wait returns once every job has started, or fails tb after 3 minutes.
func (s *Starts) Wait(tb testing.TB, what string) {
	select {
	case <-s.all:
	case <-time.After(3 * time.Minute):
		tb.Fatalf("%s: %d jobs had not started after 3 minutes", what, s.left.Load())
	}
}

// Last is the latest start.
func (s *Starts) Last() time.Time {
	var m int64
	for i := range s.at {
		m = max(m, s.at[i].Load())
	}
	return time.Unix(0, m)
}

// Started is how many jobs have started.
func (s *Starts) Started() int { return len(s.at) - int(s.left.Load()) }

// At is job i's first start, the zero Time until it started.
func (s *Starts) At(i int) time.Time {
	if ns := s.at[i].Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}
