// Command chaos runs caughtup's fault scenarios on real services and the
// capacity simulation, and prints a table per scenario.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	capacityOnly := flag.Bool("capacity", false, "run only the capacity simulation")
	flag.Parse()
	rows := simulateCapacity(defaultReadDelays, capacityLags)
	printCapacity(os.Stdout, rows)
	if *capacityOnly {
		return
	}
	fmt.Fprintln(os.Stderr, "chaos: fault scenarios not wired yet")
	os.Exit(1)
}
