//go:build unix

package kafkasuite

import (
	"syscall"
	"time"
)

// ProcessCPUTime is the CPU time this process has used, user and system
// (the benchmarks' CPU per message, which a machine shared with other
// work does not inflate as it does wall-clock time).
func ProcessCPUTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
