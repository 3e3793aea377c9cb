// Command caughtup is the operator's tool for caughtup: decode and encode
// tokens, watch replica positions during a lag incident, publish replica
// positions to a position feed, and check a deployment before relying on
// it. The demo (cmd/caughtup-demo) and
// the chaos suite (chaos/) are separate commands: this binary links no
// test harness.
//
//	caughtup token decode 'v1;...'
//	caughtup token encode --database main --system-id 7301... --timeline 1 --lsn 0/16B3740
//	caughtup watch --primary postgres://... --replica r1=postgres://...
//	caughtup feed --primary postgres://... --replica r1=postgres://... --redis redis://redis:6379/0
//	caughtup doctor --primary postgres://... --replica r1=postgres://... --redis redis://redis:6379/0
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
)

// exitUsage is the status for bad input: a malformed token or flag.
const exitUsage = 2

// usageError marks errors caused by the caller's input.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"token", "decode and encode caughtup tokens", runToken},
		{"watch", "live replica positions, lag and tracker health", runWatch},
		{"feed", "publish replica positions to a position feed for a fleet of routers", runFeed},
		{"doctor", "check a deployment: nodes, replication, one server per replica URL, grants, clock, Redis ACL", runDoctor},
	}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		printUsage(stdout)
		if len(args) == 0 {
			return exitUsage
		}
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, args[1:], stdout, stderr)
		var ue usageError
		switch {
		case err == nil, errors.Is(err, flag.ErrHelp):
			return 0
		case errors.As(err, &ue):
			fmt.Fprintln(stderr, "caughtup "+c.name+": "+ue.msg)
			return exitUsage
		default:
			fmt.Fprintln(stderr, "caughtup "+c.name+": "+err.Error())
			return 1
		}
	}
	fmt.Fprintf(stderr, "caughtup: unknown command %q; run 'caughtup --help'\n", args[0])
	return exitUsage
}

func printUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: caughtup <command> [flags]\n\ncommands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-7s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nRun 'caughtup <command> --help' for a command's flags.")
}

// newFlagSet returns a flag set that reports errors instead of exiting and
// prints help to stdout. The flags named in hidden are accepted but left
// out of the help: doctor takes a feed's command line, flags it does not
// use included.
func newFlagSet(synopsis string, stdout io.Writer, hidden ...string) *flag.FlagSet {
	name, _, _ := strings.Cut(synopsis, " ")
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stdout)
	fs.Usage = func() {
		fmt.Fprintf(stdout, "usage: caughtup %s\n\n", synopsis)
		shown := flag.NewFlagSet(name, flag.ContinueOnError)
		shown.SetOutput(stdout)
		fs.VisitAll(func(f *flag.Flag) {
			if !slices.Contains(hidden, f.Name) {
				shown.Var(f.Value, f.Name, f.Usage)
				shown.Lookup(f.Name).DefValue = f.DefValue
			}
		})
		shown.PrintDefaults()
	}
	return fs
}

// parseFlags parses args and turns flag errors into usage errors; the flag
// package has already printed the message and usage.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError{err.Error()}
	}
	return nil
}
