//go:build !unix

package kafkasuite

import "time"

// ProcessCPUTime is unknown here: the benchmarks report 0.
func ProcessCPUTime() time.Duration { return 0 }
