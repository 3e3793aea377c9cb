// Command asynq-worker is caughtup's asynq adapter end to end: a producer
// inserts rows on the primary and enqueues one task per row, a worker reads
// each row from the pool caughtup chose for the task, and replay on the
// replicas is paused at random meanwhile. It prints
//
//	tasks=100 stale=0 lost=0
//
// on stdout (a stale task read a replica that did not have its row yet; a
// lost task never completed) and where the tasks ran on stderr.
//
// Without configuration it starts its own primary with two streaming
// replicas and a redis-server (PostgreSQL 15 server binaries and
// redis-server must be installed) and pauses their replay at random.
// To use existing services instead:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	REDIS_ADDR=localhost:6379 asynq-worker -tasks 1000
//
// It then creates the table caughtup_example_items (dropping an old one)
// and pauses nothing.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/examplesvc"
)

func main() { examplesvc.Main("asynq-worker", run) }

const (
	table    = "caughtup_example_items"
	taskType = "item:check"
)

type options struct {
	tasks       int
	producers   int
	concurrency int
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var o options
	fs := examplesvc.NewFlags("asynq-worker", stderr, 2*time.Second)
	fs.IntVar(&o.tasks, "tasks", 100, "tasks to produce")
	fs.IntVar(&o.producers, "producers", 4, "producer goroutines")
	fs.IntVar(&o.concurrency, "concurrency", 20, "asynq worker concurrency")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.tasks < 1 || o.producers < 1 || o.concurrency < 1 {
		return errors.New("-tasks, -producers and -concurrency must be positive")
	}

	svc, err := examplesvc.Postgres(ctx, stderr)
	if err != nil {
		return err
	}
	defer svc.Close()
	redisAddr, err := svc.Redis(ctx, stderr)
	if err != nil {
		return err
	}
	redisOpt := asynq.RedisClientOpt{Addr: redisAddr}
	if _, err := svc.Primary.Exec(ctx, `DROP TABLE IF EXISTS `+table+`; CREATE TABLE `+table+` (id bigint PRIMARY KEY, val text NOT NULL)`); err != nil {
		return err
	}
	if svc.Cluster != nil {
		if err := svc.Cluster.WaitReplicasCaughtUp(ctx); err != nil {
			return err
		}
	}

	// The worker side: one router per process, and one server that routes
	// every task before its handler runs and keeps deferrals from costing
	// retries.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: svc.Primary, Replicas: replay.Replicas(svc.Replicas...)}},
		Logger:    slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError})),
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
		Logger:   slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError})),
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
	client := caughtupasynq.NewClient(aq)

	stopPauses := svc.PauseReplay(ctx, fs.MaxPause, stderr)
	err = produce(ctx, o, svc.Primary, client)
	stopPauses()
	if err != nil {
		return err
	}

	if err := examplesvc.Await(ctx, st.done, fs.Timeout); err != nil {
		return err
	}
	srv.Shutdown()
	fmt.Fprintln(stdout, st.summary())
	fmt.Fprintln(stderr, st.details())
	return nil
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
	stale    int
	retried  int // runs after a failed attempt: deferrals must not count as one
	runs     atomic.Int64
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
	s.runs.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
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
	fmt.Fprintf(&b, "runs=%d retried=%d", s.runs.Load(), s.retried)
	for _, o := range []consume.Outcome{consume.OutcomeReplica, consume.OutcomeReplicaWaited, consume.OutcomePrimary, consume.OutcomePrimaryNoToken, consume.OutcomePrimaryEpoch} {
		if n := s.outcomes[o]; n > 0 {
			fmt.Fprintf(&b, " %s=%d", o, n)
		}
	}
	return b.String()
}
