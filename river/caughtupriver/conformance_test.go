package caughtupriver_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/river/caughtupriver"
	"github.com/caughtup/caughtup/testkit/conformance"
)

// confArgs is the suite's job.
type confArgs struct {
	ID  int64  `json:"id"`
	Key string `json:"key"`
}

func (confArgs) Kind() string { return "conformance_job" }

// driver runs the conformance suite through River: caughtupriver.Insert
// and the Middleware, on the suite's database (River's schema is migrated
// there when the consumer starts, before anything is produced).
//
// stamped says how Produce inserts: with the context's token in the
// metadata (Insert), or with none (the job is routed against the
// primary's position read after its fetch).
type driver struct {
	t       *testing.T
	stamped bool

	mu     sync.Mutex
	insert *river.Client[pgx.Tx] // insert-only, on the suite's primary
}

var (
	_ conformance.Driver            = (*driver)(nil)
	_ conformance.RetryCounter      = (*driver)(nil)
	_ conformance.DeadLetterCounter = (*driver)(nil)
)

func (d *driver) inserter() (*river.Client[pgx.Tx], error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.insert == nil {
		return nil, errors.New("conformance driver: Produce before Consume")
	}
	return d.insert, nil
}

func (d *driver) Produce(ctx context.Context, job conformance.Job) error {
	c, err := d.inserter()
	if err != nil {
		return err
	}
	args := confArgs{ID: job.ID, Key: job.Key}
	if d.stamped {
		_, err = caughtupriver.Insert(ctx, c, args, nil)
	} else {
		_, err = c.Insert(ctx, args, nil)
	}
	return err
}

func (d *driver) ProduceRaw(ctx context.Context, job conformance.Job, header string) error {
	c, err := d.inserter()
	if err != nil {
		return err
	}
	var opts *river.InsertOpts
	if header != "" {
		md, err := json.Marshal(map[string]string{caughtupriver.MetadataKey: header})
		if err != nil {
			return err
		}
		opts = &river.InsertOpts{Metadata: md}
	}
	_, err = c.Insert(ctx, confArgs{ID: job.ID, Key: job.Key}, opts)
	return err
}

type attemptKey struct{}

type confWorker struct {
	river.WorkerDefaults[confArgs]
	handle conformance.Handler
}

func (w *confWorker) Work(ctx context.Context, job *river.Job[confArgs]) error {
	return w.handle(context.WithValue(ctx, attemptKey{}, job.Attempt), conformance.Job{ID: job.Args.ID, Key: job.Args.Key})
}

// soonRetry retries a real handler error (in the balanced scenario,
// connections that kept reaching the paused standby) soon, as the asynq
// driver does: River's default backoff would make a scenario's length
// depend on whether one happened. Snoozes do not go through it.
type soonRetry struct{}

func (soonRetry) NextRetry(*rivertype.JobRow) time.Time {
	return time.Now().Add(200 * time.Millisecond)
}

func (d *driver) Consume(ctx context.Context, router *consume.Router, policy consume.Policy, handle conformance.Handler) (func() error, error) {
	primary := router.Config().Databases["main"].Primary
	migrate(d.t, primary)
	d.mu.Lock()
	if d.insert == nil {
		c, err := river.NewClient(riverpgxv5.New(primary), &river.Config{Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			d.mu.Unlock()
			return nil, err
		}
		d.insert = c
	}
	d.mu.Unlock()
	mw, err := caughtupriver.NewMiddleware(router, caughtupriver.Config{
		DefaultPolicy: policy,
		// The suite's missing-token scenario wants a job without a token to
		// read the primary; the unstamped driver has its own scenario.
		UnstampedReadPrimary: d.stamped,
		Logger:               slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return nil, err
	}
	ws := river.NewWorkers()
	river.AddWorker(ws, &confWorker{handle: handle})
	c, err := river.NewClient(riverpgxv5.New(primary), &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 32}},
		Workers:           ws,
		Middleware:        []rivertype.Middleware{mw},
		FetchCooldown:     5 * time.Millisecond,
		FetchPollInterval: 50 * time.Millisecond,
		RetryPolicy:       soonRetry{},
		Logger:            slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return nil, err
	}
	if err := c.Start(ctx); err != nil {
		return nil, err
	}
	return func() error {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return c.Stop(sctx)
	}, nil
}

// RetryCount is the attempts before this one: River counts the running
// attempt in JobRow.Attempt, and a snooze gives it back.
func (d *driver) RetryCount(ctx context.Context) int {
	n, _ := ctx.Value(attemptKey{}).(int)
	return max(n-1, 0)
}

// DeadLettered is how many of the suite's jobs River discarded.
func (d *driver) DeadLettered(ctx context.Context) (int, error) {
	c, err := d.inserter()
	if err != nil {
		return 0, err
	}
	res, err := c.JobList(ctx, river.NewJobListParams().States(rivertype.JobStateDiscarded).First(10000))
	if err != nil {
		return 0, err
	}
	return len(res.Jobs), nil
}

func conformanceJobs(t *testing.T) int {
	jobs := 10000
	if testing.Short() {
		jobs = 1000
	}
	if v := os.Getenv("CAUGHTUP_CONFORMANCE_JOBS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err)
		jobs = n
	}
	return jobs
}

// TestConformance runs the freshness suite with jobs stamped through
// Insert. The fresh-reads scenario has 10,000 jobs (1,000 with -short);
// CAUGHTUP_CONFORMANCE_JOBS overrides.
func TestConformance(t *testing.T) {
	conformance.Run(t, conformance.Config{
		NewDriver: func(t *testing.T) conformance.Driver { return &driver{t: t, stamped: true} },
		Jobs:      conformanceJobs(t),
	})
}

// TestConformanceFetchPosition runs the fresh-reads scenario with jobs
// that carry no token, as InsertTx's do: every one is routed against the
// primary's position read after its fetch.
func TestConformanceFetchPosition(t *testing.T) {
	rep := conformance.FreshReads(t, conformance.Config{
		NewDriver: func(t *testing.T) conformance.Driver { return &driver{t: t} },
		Jobs:      conformanceJobs(t),
	})
	require.Zero(t, rep.Stale)
}
