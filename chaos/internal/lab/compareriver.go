package lab

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/river/caughtupriver"
)

// riverCompare is the comparison's River pipeline: a queue per policy in
// the comparison's database, each filled by caughtupriver.Insert after the
// write's commit (the commit's token in the job's metadata, which the
// baselines read as they read asynq's and Kafka's header) and worked by a
// client of its own: caughtup's middleware on the first, the baselines'
// routing in the worker on the others.
type riverCompare struct {
	pool    *pgxpool.Pool
	clients []*river.Client[pgx.Tx]
	streams []*stream
}

// startRiverCompare installs River's schema in env's database and starts
// a client per policy; policies[0] is caughtup's, the others
// baselines[i-1]'s. GitLab's retry through the queue is a failed attempt,
// run again after 1s, the delay of caughtup's first deferral, as the asynq
// baselines'.
func (s *services) startRiverCompare(ctx context.Context, env *dbEnv, base string, policies []string, baselines []baseline) (*riverCompare, error) {
	rc := &riverCompare{}
	var err error
	if rc.pool, err = newPrimaryPool(ctx, primaryDSN(env.cluster, env.name), 30, "chaos-river-compare", nil); err != nil {
		return nil, err
	}
	m, err := rivermigrate.New(riverpgxv5.New(rc.pool), nil)
	if err != nil {
		return rc, err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return rc, fmt.Errorf("migrate River's schema: %w", err)
	}
	for i, pol := range policies {
		st := newStream("river/"+pol, "river", pol)
		rc.streams = append(rc.streams, st)
		queue := base + "-river-" + pol
		counting := riverCounting(func(riverArgs) *stream { return st })
		var c *river.Client[pgx.Tx]
		if i == 0 {
			mw, err := caughtupriver.NewMiddleware(env.router, caughtupriver.Config{DefaultPolicy: consume.Delayed, Logger: s.log})
			if err != nil {
				return rc, err
			}
			c, err = newRiverClient(rc.pool, queue, riverWorkers, riverRetry, s.log, func(ctx context.Context, job *river.Job[riverArgs]) error {
				return caughtupReadSince(ctx, st, job.Args.payload, riverTokenText(job.JobRow), job.CreatedAt, job.Attempt-1)
			}, counting, mw)
			if err != nil {
				return rc, err
			}
		} else {
			b := baselines[i-1]
			c, err = newRiverClient(rc.pool, queue, riverWorkers, time.Second, s.log, func(ctx context.Context, job *river.Job[riverArgs]) error {
				return baselineRead(ctx, b, st, job.Args.payload, riverTokenText(job.JobRow), job.Attempt > 1)
			}, counting)
			if err != nil {
				return rc, err
			}
		}
		if err := c.Start(context.WithoutCancel(ctx)); err != nil {
			return rc, err
		}
		rc.clients = append(rc.clients, c)
	}
	return rc, nil
}

// sinks are the comparison's River lane: one Insert per policy's queue
// for each job, with the token ctx carries.
func (rc *riverCompare) sinks(base string, policies []string) []sink {
	var out []sink
	for i, pol := range policies {
		queue := base + "-river-" + pol
		out = append(out, sink{streams: []*stream{rc.streams[i]}, send: func(ctx context.Context, p payload) error {
			_, err := caughtupriver.Insert(ctx, rc.clients[0], riverArgs{payload: p}, &river.InsertOpts{Queue: queue})
			return err
		}})
	}
	return out
}

// stop stops the clients, then closes the pool.
func (rc *riverCompare) stop() error {
	if rc == nil {
		return nil
	}
	var errs []error
	for _, c := range rc.clients {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if err := c.Stop(ctx); err != nil {
			errs = append(errs, fmt.Errorf("a River client did not stop within 30s: %w", err))
		}
		cancel()
	}
	rc.clients = nil
	if rc.pool != nil {
		rc.pool.Close()
		rc.pool = nil
	}
	return errors.Join(errs...)
}
