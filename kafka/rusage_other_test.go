//go:build !unix

package kafka_test

import "time"

// cpuTime is unknown here: the benchmark reports 0.
func cpuTime() time.Duration { return 0 }
