// Command caughtup-demo is `make demo`: a small profile-update app on
// embedded services (a PostgreSQL primary with two streaming replicas,
// redis-server, an in-process Kafka broker) whose jobs and outbox events
// are consumed with and without caughtup through a lag spike and a
// failover. It prints what each saw, needs no flags and cleans up after
// itself.
//
//	go run ./cmd/caughtup-demo
//	go run ./cmd/caughtup-demo -duration 60s -rate 200
//
// Its cluster subcommand starts the demo's cluster alone (a primary with
// two streaming replicas and redis-server; with -kafka a Kafka broker, with
// -debezium also Kafka Connect with Debezium), pauses replay at random if
// asked, and runs a command with the cluster's addresses in its
// environment: that is how each program under examples/ runs with one
// command.
//
//	go run ./cmd/caughtup-demo cluster -max-pause 1s -- go run ./examples/asynq-worker
//	go run ./cmd/caughtup-demo cluster -kafka   # prints the environment and waits
//
// It is a separate command so that the product binary, cmd/caughtup,
// links none of the test harnesses the demo starts its services with.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the command; it returns the exit status: 2 for bad flags, 1 when
// the demo failed or did not show what it should.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "cluster" {
		return runCluster(ctx, args[1:], stdout, stderr)
	}
	fs := flag.NewFlagSet("caughtup-demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "usage: caughtup-demo [-duration 30s] [-rate 80] [-live=auto]\n"+
			"       caughtup-demo cluster [-kafka] [-debezium] [-max-pause 1s] [-- command [args...]]\n\n"+
			"Starts a PostgreSQL primary with two streaming replicas, redis-server and an\n"+
			"in-process Kafka broker; runs a profile-update app whose jobs and outbox events\n"+
			"are consumed with and without caughtup through a lag spike and a failover; and\n"+
			"prints what each saw. Needs no flags; cleans up after itself.\n\n"+
			"cluster starts the services alone and runs a command with them in its\n"+
			"environment (caughtup-demo cluster -h says more).\n\n")
		fs.PrintDefaults()
	}
	duration := fs.Duration("duration", 30*time.Second, "how long the traffic runs (at least 10s)")
	rate := fs.Int("rate", 80, "profile updates per second")
	live := fs.String("live", "auto", "redraw the view in place: auto (when stdout is a terminal), true or false")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 || *duration < 10*time.Second || *rate <= 0 {
		fmt.Fprintln(stderr, "caughtup-demo: -duration must be at least 10s and -rate positive, and no arguments follow the flags")
		return 2
	}
	opts := Options{Out: stdout, Duration: *duration, Rate: *rate}
	switch *live {
	case "auto":
		opts.Live = isTerminal(stdout)
	case "true":
		opts.Live = true
	case "false":
	default:
		fmt.Fprintln(stderr, "caughtup-demo: -live: want auto, true or false")
		return 2
	}
	// Place the faults in proportion to the run.
	opts.SpikeAt = *duration / 6
	opts.SpikeFor = min(4*time.Second, *duration/6)
	opts.FailoverAt = *duration / 2
	res, err := Run(ctx, opts)
	if err != nil {
		fmt.Fprintln(stderr, "caughtup-demo: "+err.Error())
		return 1
	}
	if !res.OK() {
		fmt.Fprintln(stderr, "caughtup-demo: the demo did not show what it should: see the table")
		return 1
	}
	return 0
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
