//go:build !race

package asynq_test

const raceEnabled = false
