package main

import (
	"context"
	"errors"
	"io"
	"os"
	"time"

	"github.com/caughtup/caughtup/internal/demo"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo [--duration 30s] [--rate 80] [--live=auto]\n\n"+
		"Starts a PostgreSQL primary with two streaming replicas, redis-server and an\n"+
		"in-process Kafka broker; runs a profile-update app whose jobs and outbox events\n"+
		"are consumed with and without caughtup through a lag spike and a failover; and\n"+
		"prints what each saw. Needs no flags; cleans up after itself.", stdout)
	duration := fs.Duration("duration", 30*time.Second, "how long the traffic runs")
	rate := fs.Int("rate", 80, "profile updates per second")
	live := fs.String("live", "auto", "redraw the view in place: auto (when stdout is a terminal), true or false")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *duration < 10*time.Second || *rate <= 0 {
		return usageError{"--duration must be at least 10s and --rate positive"}
	}
	opts := demo.Options{Out: stdout, Duration: *duration, Rate: *rate}
	switch *live {
	case "auto":
		opts.Live = isTerminal(stdout)
	case "true":
		opts.Live = true
	case "false":
	default:
		return usageError{"--live: want auto, true or false"}
	}
	// Place the faults in proportion to the run.
	opts.SpikeAt = *duration / 6
	opts.SpikeFor = min(4*time.Second, *duration/6)
	opts.FailoverAt = *duration / 2
	res, err := demo.Run(ctx, opts)
	if err != nil {
		return err
	}
	if !res.OK() {
		return errors.New("the demo did not show what it should: see the table")
	}
	return nil
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
