//go:build race

package asynq_test

// raceEnabled: the race detector slows the in-process path far more than
// Redis round trips, so throughput runs are shorter and their ratio is
// not the one to report.
const raceEnabled = true
