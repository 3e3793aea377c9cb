// Package latency holds what the benchmarks and the chaos and fleet
// programs share to summarise what they measure: one percentile rule, so
// that a p99 means the same in every table, and a recorder of published
// snapshots to find when a replica caught up.
//
//	stop := latency.Follow(router.Snapshot)
//	// … run the jobs …
//	snaps := stop()
//	p99 := latency.Percentile(durations, 0.99)
package latency

import (
	"cmp"
	"slices"
)

// Percentile is the nearest-rank p-quantile of s (0 < p ≤ 1): the smallest
// sample that at least p·len(s) samples do not exceed; p = 1 is the
// largest. It is the zero value for no samples, and leaves s as it is.
func Percentile[T cmp.Ordered](s []T, p float64) T {
	if len(s) == 0 {
		var zero T
		return zero
	}
	sorted := slices.Clone(s)
	slices.Sort(sorted)
	// The rank rounded up, with room for the float error of len·p (200 ×
	// 0.99 must be rank 198, not 199).
	i := int(float64(len(sorted))*p+0.999999) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// Follow records every value current returns, each time the last one's
// Changed channel closes (consume.Router.Snapshot and replay.Snapshot
// behave so), until the returned stop is called; stop returns them oldest
// first. A value replaced while the follower was busy is not recorded.
func Follow[S interface{ Changed() <-chan struct{} }](current func() S) (stop func() []S) {
	var (
		got  []S
		quit = make(chan struct{})
		done = make(chan struct{})
	)
	go func() {
		defer close(done)
		for {
			s := current()
			got = append(got, s)
			select {
			case <-s.Changed():
			case <-quit:
				return
			}
		}
	}()
	return func() []S {
		close(quit)
		<-done
		return got
	}
}
