//go:build !linux

package kafkasuite

import "time"

// MachineCPUTime is unknown here: the benchmarks report 0.
func MachineCPUTime() time.Duration { return 0 }
