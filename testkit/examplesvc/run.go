package examplesvc

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"
)

// RunFunc is an example's program: flags in args, its summary on stdout,
// progress and details on stderr. Tests call it directly.
type RunFunc func(ctx context.Context, args []string, stdout, stderr io.Writer) error

// Main runs run with the command line and the standard streams until it
// returns or SIGINT or SIGTERM cancels it, and exits 1 with the error
// prefixed by name if it fails.
func Main(name string, run RunFunc) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
}

// Go runs run (a consumer's or a relay's Run) in a goroutine on a context
// of its own. stop cancels that context, waits for run to return and
// returns its error; later calls return the same error without waiting
// again, so a deferred stop after an explicit one is harmless.
func Go(ctx context.Context, run func(context.Context) error) (stop func() error) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	return sync.OnceValue(func() error {
		cancel()
		return <-done
	})
}

// Flags is an example's flag set with the flags every example has.
type Flags struct {
	*flag.FlagSet
	// MaxPause is -max-pause: the longest random replay pause on a
	// throwaway cluster (see Services.PauseReplay); 0: none.
	MaxPause time.Duration
	// Timeout is -timeout: how long to wait for every message to run once
	// the producer is done; those that have not are counted as lost.
	// Default 2 minutes: a consumer that has to wait out a long pause, on a
	// busy machine, still finishes well within it.
	Timeout time.Duration
}

// NewFlags returns the flag set of the example name, which reports errors
// on stderr and returns them from Parse, with -max-pause (default
// maxPause) and -timeout defined; the example adds its own.
func NewFlags(name string, stderr io.Writer, maxPause time.Duration) *Flags {
	f := &Flags{FlagSet: flag.NewFlagSet(name, flag.ContinueOnError)}
	f.SetOutput(stderr)
	f.DurationVar(&f.MaxPause, "max-pause", maxPause, "longest random replay pause (own cluster only; 0: none)")
	f.DurationVar(&f.Timeout, "timeout", 2*time.Minute, "how long to wait for every message to run once produced")
	return f
}
