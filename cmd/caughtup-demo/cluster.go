package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/caughtup/caughtup/testkit/examplesvc"
)

const clusterUsage = `usage: caughtup-demo cluster [-kafka] [-debezium] [-max-pause 1s] [-- command [args...]]

Starts the demo's cluster: a PostgreSQL primary with two streaming replicas
and redis-server, with -kafka an Apache Kafka broker, with -debezium also a
Kafka Connect worker with the Debezium PostgreSQL connector. With
-max-pause, replay on the replicas pauses at random meanwhile.

With a command, runs it with the cluster in its environment and exits with
its status, the cluster stopped:

	caughtup-demo cluster -max-pause 1s -- go run ./examples/asynq-worker

Without one, prints the environment as export lines and keeps the cluster
up until interrupted, for examples run from another shell.

The environment: CAUGHTUP_PRIMARY_URL, CAUGHTUP_REPLICA_URLS (comma-
separated), REDIS_ADDR, and with -kafka KAFKA_BROKERS, with -debezium
KAFKA_CONNECT_URL. The database is "example". With KAFKA_BROKERS already
set, -kafka uses those brokers and starts none.

`

// runCluster is `caughtup-demo cluster`; it returns the exit status: 2 for
// bad flags, 1 when the cluster did not start, else the command's.
func runCluster(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("caughtup-demo cluster", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), clusterUsage)
		fs.PrintDefaults()
	}
	withKafka := fs.Bool("kafka", false, "also start a Kafka broker (KAFKA_BROKERS)")
	withDebezium := fs.Bool("debezium", false, "also start Kafka Connect with the Debezium PostgreSQL connector (KAFKA_CONNECT_URL); implies -kafka")
	maxPause := fs.Duration("max-pause", 0, "pause replay on the replicas at random, up to this long at a time (0: never)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *maxPause < 0 {
		fmt.Fprintln(stderr, "caughtup-demo cluster: -max-pause must not be negative")
		return 2
	}
	command := fs.Args()

	what := "a primary with 2 streaming replicas and redis-server"
	switch {
	case *withDebezium:
		what = "a primary with 2 streaming replicas, redis-server, a Kafka broker and Kafka Connect with Debezium"
	case *withKafka:
		what = "a primary with 2 streaming replicas, redis-server and a Kafka broker"
	}
	fmt.Fprintf(stderr, "caughtup-demo cluster: starting %s…\n", what)
	began := time.Now()
	c, err := examplesvc.Start(ctx, examplesvc.Options{Kafka: *withKafka, Debezium: *withDebezium})
	if err != nil {
		fmt.Fprintln(stderr, "caughtup-demo cluster:", err)
		return 1
	}
	defer func() {
		if err := c.Close(); err != nil {
			fmt.Fprintln(stderr, "caughtup-demo cluster:", err)
		}
	}()
	env := c.Env(examplesvc.Database)
	pauses := "replay streams"
	if *maxPause > 0 {
		pauses = fmt.Sprintf("replay pauses at random for up to %s at a time", *maxPause)
	}
	fmt.Fprintf(stderr, "caughtup-demo cluster: up in %s; %s\n", time.Since(began).Round(100*time.Millisecond), pauses)
	stopPauses := c.PauseReplay(ctx, *maxPause, func(f string, a ...any) {
		if ctx.Err() == nil { // interrupted, the services stop under the pauses
			fmt.Fprintf(stderr, "caughtup-demo cluster: "+f+"\n", a...)
		}
	})
	defer stopPauses()

	if len(command) == 0 {
		for _, kv := range env {
			k, v, _ := strings.Cut(kv, "=")
			fmt.Fprintf(stdout, "export %s='%s'\n", k, v)
		}
		fmt.Fprintln(stderr, "caughtup-demo cluster: run the examples in another shell with these variables; Ctrl-C stops the cluster")
		<-ctx.Done()
		return 0
	}

	cmd := exec.CommandContext(ctx, command[0], command[1:]...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, stdout, stderr
	// Stopped early (SIGTERM), the command gets to stop too, and to
	// clean up what it created.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	err = cmd.Run()
	stopPauses()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit) && exit.ExitCode() > 0:
		return exit.ExitCode()
	default:
		fmt.Fprintf(stderr, "caughtup-demo cluster: %s: %v\n", command[0], err)
		return 1
	}
}
