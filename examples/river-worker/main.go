// Command river-worker is caughtup's River adapter end to end: a producer
// inserts rows on the primary and one River job per row, and a worker
// reads each row from the pool caughtup chose for the job. Half the jobs
// are inserted with InsertTx in the row's transaction (no token: routed by
// a position of the primary's read after the job's commit), half after the
// commit with caughtupriver.Insert (the commit's token in the job's
// metadata). A job no replica can serve yet is snoozed, and woken as soon
// as one has caught up. It
// prints
//
//	jobs=100 stale=0 lost=0
//
// on stdout (a stale job read a replica that did not have its row yet; a
// lost job never completed) and where the jobs ran on stderr.
//
// One command runs it on the demo's cluster (a primary with two streaming
// replicas, replay paused at random on the replicas):
//
//	make example EXAMPLE=river-worker
//
// that is,
//
//	go run ./cmd/caughtup-demo cluster -max-pause 1s -- go run ./examples/river-worker
//
// On your own services:
//
//	CAUGHTUP_PRIMARY_URL=postgres://app@primary/app \
//	CAUGHTUP_REPLICA_URLS=postgres://app@replica1/app,postgres://app@replica2/app \
//	go run ./examples/river-worker -jobs 1000
//
// It creates the table caughtup_example_items (dropping an old one) and
// migrates River's schema up (rivermigrate) in that database.
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
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/river/caughtupriver"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "river-worker:", err)
		os.Exit(1)
	}
}

const table = "caughtup_example_items"

// CheckArgs is the job: read row ID.
type CheckArgs struct {
	ID int64 `json:"id"`
}

// Kind is the River job kind, which Config.Policies is keyed by.
func (CheckArgs) Kind() string { return "item_check" }

type options struct {
	jobs, producers, workers int
	timeout                  time.Duration
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	var o options
	fs := flag.NewFlagSet("river-worker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.jobs, "jobs", 100, "jobs to produce")
	fs.IntVar(&o.producers, "producers", 4, "producer goroutines")
	fs.IntVar(&o.workers, "workers", 20, "River MaxWorkers")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long to wait for every job once produced; the rest are lost")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.jobs < 1 || o.producers < 1 || o.workers < 1 {
		return errors.New("-jobs, -producers and -workers must be positive")
	}
	primaryURL, err := need(getenv, "CAUGHTUP_PRIMARY_URL", "the primary's URL")
	if err != nil {
		return err
	}
	replicaURLs, err := need(getenv, "CAUGHTUP_REPLICA_URLS", "its streaming replicas' URLs, comma-separated")
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
	migrator, err := rivermigrate.New(riverpgxv5.New(primary), nil)
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("migrating River's schema: %w", err)
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelError}))

	// The worker side: one router per process, and the middleware on the
	// River client; the worker takes its pool from the context.
	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replicas...)}},
		Logger:    logger,
	})
	if err != nil {
		return err
	}
	defer router.Close()
	mw, err := caughtupriver.NewMiddleware(router, caughtupriver.Config{
		Policies: map[string]consume.Policy{"item_check": consume.Delayed},
		Logger:   logger,
	})
	if err != nil {
		return err
	}
	st := newStats(o.jobs)
	workers := river.NewWorkers()
	river.AddWorker(workers, river.WorkFunc(st.work))
	client, err := river.NewClient(riverpgxv5.New(primary), &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: o.workers}},
		Workers:           workers,
		Middleware:        []rivertype.Middleware{mw},
		FetchPollInterval: 100 * time.Millisecond,
		Logger:            logger,
	})
	if err != nil {
		return err
	}
	if err := client.Start(ctx); err != nil {
		return err
	}
	stopped := false
	stopClient := func() {
		if !stopped {
			stopped = true
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = client.Stop(sctx)
		}
	}
	defer stopClient()

	if err := produce(ctx, o, primary, client); err != nil {
		return err
	}

	timer := time.NewTimer(o.timeout)
	defer timer.Stop()
	select {
	case <-st.done:
	case <-timer.C: // the summary counts the missing jobs as lost
	case <-ctx.Done():
		return ctx.Err()
	}
	stopClient()
	fmt.Fprintln(stdout, st.summary())
	fmt.Fprintln(stderr, st.details())
	return nil
}

// need returns the environment variable name, or an error that names it.
func need(getenv func(string) string, name, what string) (string, error) {
	if v := strings.TrimSpace(getenv(name)); v != "" {
		return v, nil
	}
	return "", fmt.Errorf("%s is not set: it names %s (`make example EXAMPLE=river-worker` starts the demo's cluster and sets it)", name, what)
}

// produce inserts the rows and their jobs: even ids with InsertTx in the
// row's transaction, odd ids with caughtupriver.Insert after the commit.
func produce(ctx context.Context, o options, primary *pgxpool.Pool, client *river.Client[pgx.Tx]) error {
	ids := make(chan int64)
	errs := make(chan error, o.producers)
	var wg sync.WaitGroup
	for range o.producers {
		wg.Go(func() {
			for id := range ids {
				if err := produceOne(ctx, primary, client, id); err != nil {
					errs <- fmt.Errorf("job %d: %w", id, err)
					return
				}
			}
		})
	}
	var err error
loop:
	for id := int64(1); id <= int64(o.jobs); id++ {
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

func produceOne(ctx context.Context, primary *pgxpool.Pool, client *river.Client[pgx.Tx], id int64) error {
	if id%2 == 0 {
		// River's recommended way: the job commits with the row. No token
		// exists yet; the middleware reads the primary's position after
		// the fetch.
		return pgx.BeginFunc(ctx, primary, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO `+table+` (id, val) VALUES ($1, $2)`, id, value(id)); err != nil {
				return err
			}
			_, err := client.InsertTx(ctx, tx, CheckArgs{ID: id}, nil)
			return err
		})
	}
	// After the commit: the context carries its token, and Insert puts it
	// in the job's metadata.
	ctx, err := enqueue.InTx(ctx, primary, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+table+` (id, val) VALUES ($1, $2)`, id, value(id))
		return err
	})
	if err != nil {
		var ce *enqueue.CaptureError
		if !errors.As(err, &ce) || !ce.Committed {
			return err // rolled back: nothing to insert
		}
		// Committed, only the token is missing: the job goes without one
		// and is routed by the position after its fetch.
	}
	_, err = caughtupriver.Insert(ctx, client, CheckArgs{ID: id}, nil)
	return err
}

func value(id int64) string { return fmt.Sprintf("item-%d", id) }

// stats is what the worker saw.
type stats struct {
	want     int
	mu       sync.Mutex
	ran      map[int64]bool
	outcomes map[consume.Outcome]int
	runs     int
	stale    int
	retried  int // runs after a failed attempt: snoozes must not count as one
	done     chan struct{}
}

func newStats(want int) *stats {
	return &stats{want: want, ran: map[int64]bool{}, outcomes: map[consume.Outcome]int{}, done: make(chan struct{})}
}

// work is the application's worker: it reads its row from the pool
// caughtup chose, which is all a worker changes.
func (s *stats) work(ctx context.Context, job *river.Job[CheckArgs]) error {
	id := job.Args.ID
	var val string
	err := consume.DB(ctx, "main").QueryRow(ctx, `SELECT val FROM `+table+` WHERE id = $1`, id).Scan(&val)
	stale := errors.Is(err, pgx.ErrNoRows) || (err == nil && val != value(id))
	if err != nil && !stale {
		return err // a real error: River retries it
	}
	d, _ := consume.DecisionFrom(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runs++
	s.outcomes[d.Outcome]++
	if stale {
		s.stale++
	}
	if job.Attempt > 1 {
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
	return fmt.Sprintf("jobs=%d stale=%d lost=%d", s.want, s.stale, s.want-len(s.ran))
}

// details says where the jobs ran; it varies with timing.
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
