// Command asynq-worker is caughtup's asynq adapter end to end: a producer
// inserts rows on the primary and enqueues one task per row, and a worker
// reads each row from the pool caughtup chose for the task. It prints
//
//	tasks=100 stale=0 lost=0
//
// on stdout (a stale task read a replica that did not have its row yet; a
// lost task never completed) and where the tasks ran on stderr.
//
// One command runs it on the demo's cluster (a primary with two streaming
// replicas and redis-server, replay paused at random on the replicas):
//
//	make example EXAMPLE=asynq-worker
//
// that is,
//
//	go run ./cmd/caughtup-demo cluster -max-pause 1s -- go run ./examples/asynq-worker
//
// On your own services:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	REDIS_ADDR=localhost:6379 go run ./examples/asynq-worker -tasks 1000
//
// It creates the table caughtup_example_items (dropping an old one).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "asynq-worker:", err)
		os.Exit(1)
	}
}

const (
	table    = "caughtup_example_items"
	taskType = "item:check"
)

type options struct {
	tasks, producers, concurrency int
	timeout                       time.Duration
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	var o options
	fs := flag.NewFlagSet("asynq-worker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.tasks, "tasks", 100, "tasks to produce")
	fs.IntVar(&o.producers, "producers", 4, "producer goroutines")
	fs.IntVar(&o.concurrency, "concurrency", 20, "asynq worker concurrency")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long to wait for every task once produced; the rest are lost")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.tasks < 1 || o.producers < 1 || o.concurrency < 1 {
		return errors.New("-tasks, -producers and -concurrency must be positive")
	}
	primaryURL, err := need(getenv, "CAUGHTUP_PRIMARY_URL", "the primary's URL")
	if err != nil {
		return err
	}
	replicaURLs, err := need(getenv, "CAUGHTUP_REPLICA_URLS", "its streaming replicas' URLs, comma-separated")
	if err != nil {
		return err
	}
	redisAddr, err := need(getenv, "REDIS_ADDR", "redis-server's host:port")
	if err != nil {
		return err
	}

	primary, err := pgxpool.New(ctx, primaryURL)
	if err != nil {
		return fmt.Errorf("CAUGHTUP_PRIMARY_URL: %w", err)
	}
	defer primary.Close()
	var replicas []*pgxpool.Pool
	for _, u := range strings.Split(replicaURLs, ",") {
		p, err := pgxpool.New(ctx, strings.TrimSpace(u))
		if err != nil {
			return fmt.Errorf("CAUGHTUP_REPLICA_URLS: %w", err)
		}
		defer p.Close()
		replicas = append(replicas, p)
	}
	if _, err := primary.Exec(ctx, `DROP TABLE IF EXISTS `+table+`; CREATE TABLE `+table+` (id bigint PRIMARY KEY, val text NOT NULL)`); err != nil {
		return err
	}
	redisOpt := asynq.RedisClientOpt{Addr: redisAddr}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// The worker side: one router per process, and one server that routes
	// every task before its handler runs and keeps deferrals from costing
	// retries.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replicas...)}},
		Logger:    logger,
	})
	if err != nil {
		return err
	}
	defer router.Close()

	st := newStats(o.tasks)
	srv, err := caughtupasynq.NewServer(redisOpt, asynq.Config{
		Concurrency:       o.concurrency,
		Queues:            map[string]int{"default": 1},
		TaskCheckInterval: 100 * time.Millisecond,
		LogLevel:          asynq.ErrorLevel,
	}, router, caughtupasynq.MiddlewareConfig{
		Policies: map[string]consume.Policy{"item:": consume.Delayed},
		Logger:   logger,
	})
	if err != nil {
		return err
	}
	mux := asynq.NewServeMux()
	mux.HandleFunc(taskType, st.handle)
	if err := srv.Start(mux); err != nil {
		return err
	}
	defer srv.Shutdown()

	// The producer side: commit, then enqueue with the context the commit
	// returned; the client stamps the task with its token.
	aq := asynq.NewClient(redisOpt)
	defer aq.Close()
	if err := produce(ctx, o, primary, caughtupasynq.NewClient(aq)); err != nil {
		return err
	}

	timer := time.NewTimer(o.timeout)
	defer timer.Stop()
	select {
	case <-st.done:
	case <-timer.C: // the summary counts the missing tasks as lost
	case <-ctx.Done():
		return ctx.Err()
	}
	srv.Shutdown()
	fmt.Fprintln(stdout, st.summary())
	fmt.Fprintln(stderr, st.details())
	return nil
}

// need returns the environment variable name, or an error that names it.
func need(getenv func(string) string, name, what string) (string, error) {
	if v := strings.TrimSpace(getenv(name)); v != "" {
		return v, nil
	}
	return "", fmt.Errorf("%s is not set: it names %s (`make example EXAMPLE=asynq-worker` starts the demo's cluster and sets it)", name, what)
}

func produce(ctx context.Context, o options, primary *pgxpool.Pool, client *caughtupasynq.Client) error {
	ids := make(chan int64)
	errs := make(chan error, o.producers)
	var wg sync.WaitGroup
	for range o.producers {
		wg.Go(func() {
			for id := range ids {
				ctx, err := enqueue.InTx(ctx, primary, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `INSERT INTO `+table+` (id, val) VALUES ($1, $2)`, id, value(id))
					return err
				})
				if err == nil {
					// caughtupasynq.NewTask keeps the options where the
					// client can find them when it stamps the task.
					_, err = client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, taskType, strconv.AppendInt(nil, id, 10), asynq.MaxRetry(5)))
				}
				if err != nil {
					errs <- fmt.Errorf("task %d: %w", id, err)
					return
				}
			}
		})
	}
	var err error
loop:
	for id := int64(1); id <= int64(o.tasks); id++ {
		select {
		case ids <- id:
		case err = <-errs:
			break loop
		case <-ctx.Done():
			err = ctx.Err()
			break loop
		}
	}
	close(ids)
	wg.Wait()
	close(errs)
	if err == nil {
		err = <-errs
	}
	return err
}

func value(id int64) string { return "item-" + strconv.FormatInt(id, 10) }

// stats is what the handlers saw.
type stats struct {
	want     int
	mu       sync.Mutex
	ran      map[int64]bool
	outcomes map[consume.Outcome]int
	runs     int
	stale    int
	retried  int // runs after a failed attempt: deferrals must not count as one
	done     chan struct{}
}

func newStats(want int) *stats {
	return &stats{want: want, ran: map[int64]bool{}, outcomes: map[consume.Outcome]int{}, done: make(chan struct{})}
}

// handle is the application's handler: it reads its row from the pool
// caughtup chose, which is all a handler changes.
func (s *stats) handle(ctx context.Context, task *asynq.Task) error {
	id, err := strconv.ParseInt(string(task.Payload()), 10, 64)
	if err != nil {
		return fmt.Errorf("%w: bad payload %q", asynq.SkipRetry, task.Payload())
	}
	var val string
	err = consume.DB(ctx, "main").QueryRow(ctx, `SELECT val FROM `+table+` WHERE id = $1`, id).Scan(&val)
	stale := errors.Is(err, pgx.ErrNoRows) || (err == nil && val != value(id))
	if err != nil && !stale {
		return err // a real error: asynq retries it
	}
	d, _ := consume.DecisionFrom(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runs++
	s.outcomes[d.Outcome]++
	if stale {
		s.stale++
	}
	if n, _ := asynq.GetRetryCount(ctx); n > 0 {
		s.retried++
	}
	if !s.ran[id] {
		s.ran[id] = true
		if len(s.ran) == s.want {
			close(s.done)
		}
	}
	return nil
}

// summary is the deterministic line: the same for every correct run.
func (s *stats) summary() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprintf("tasks=%d stale=%d lost=%d", s.want, s.stale, s.want-len(s.ran))
}

// details says where the tasks ran; it varies with timing.
func (s *stats) details() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "runs=%d retried=%d", s.runs, s.retried)
	for _, o := range []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited, consume.OutcomePrimary, consume.OutcomePrimaryNoToken, consume.OutcomePrimaryEpoch} {
		if n := s.outcomes[o]; n > 0 {
			fmt.Fprintf(&b, " %s=%d", o, n)
		}
	}
	return b.String()
}
