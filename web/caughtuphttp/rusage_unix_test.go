//go:build unix

package caughtuphttp

import (
	"syscall"
	"time"
)

// processCPU is the CPU time this process has used, user and system
// (BenchmarkRequest's CPU per request: the client's, the server's and the
// middleware's, not PostgreSQL's).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
