package examplesvc

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"syscall"
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
