// Command fleet simulates a fleet of routers, on a position feed or
// polling by themselves, against a real PostgreSQL primary with two
// streaming replicas and a real redis-server, and prints a table of what
// each costs and how soon waiting jobs wake; see FleetMain in package
// chaos/internal/lab.
//
//	go run ./chaos/fleet                       # make fleet: feed N=10,100,1000; local N=10 and the most that fit
//	go run ./chaos/fleet -feed 10 -local '' -trials 5
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/caughtup/caughtup/chaos/internal/lab"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := lab.FleetMain(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
