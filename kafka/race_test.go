//go:build race

package kafka_test

const (
	raceEnabled = true
	raceNote    = "with -race, which inflates the router's share"
)
