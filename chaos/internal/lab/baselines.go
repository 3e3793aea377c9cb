package lab

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
)

// The baselines route with their own logic and exist only in this
// harness, for the comparison. They read the same token header caughtup's
// producers stamp, so the only difference is the routing.

// errRetryThroughQueue is the GitLab baseline's "retry" strategy: the job
// goes back to the queue once.
var errRetryThroughQueue = errors.New("gitlab baseline: no replica has replayed the job's position; retry through the queue")

// choice is where a baseline reads.
type choice struct {
	pool    *pgxpool.Pool
	replica string
	outcome string
}

type baseline interface {
	name() string
	// route picks the pool for a job; retried says the queue already ran
	// this job once and it failed (GitLab's retry).
	route(ctx context.Context, header string, retried bool) (choice, error)
}

// gitlab follows GitLab's Sidekiq load balancing for `delayed` workers:
// a live query per replica for replay >= the job's LSN; if none is up to
// date, sleep 0.5s and ask again, up to 3 times; then retry the job once
// through the queue; on that retry, a replica if one is up to date now,
// else the primary. Like GitLab it compares LSNs only (no epoch).
type gitlab struct {
	primary  *pgxpool.Pool
	replicas []namedPool
	next     atomic.Uint32
	sleep    time.Duration
	tries    int
}

type namedPool struct {
	name string
	pool *pgxpool.Pool
}

func (g *gitlab) name() string { return "gitlab" }

func (g *gitlab) route(ctx context.Context, header string, retried bool) (choice, error) {
	lsn, ok := headerLSN(header)
	if !ok {
		return choice{pool: g.primary, outcome: "primary_no_wal"}, nil
	}
	sleeps := g.tries
	if retried {
		// GitLab sleeps only while the job is younger than its minimum
		// delay; a retried job is past it.
		sleeps = 0
	}
	for i := 0; ; i++ {
		if p, ok := g.upToDate(ctx, lsn); ok {
			outcome := "replica"
			if i > 0 || retried {
				outcome = "replica_retried"
			}
			return choice{pool: p.pool, replica: p.name, outcome: outcome}, nil
		}
		if i == sleeps {
			break
		}
		select {
		case <-time.After(g.sleep):
		case <-ctx.Done():
			return choice{}, ctx.Err()
		}
	}
	if !retried {
		return choice{}, errRetryThroughQueue
	}
	return choice{pool: g.primary, outcome: "primary"}, nil
}

// upToDate asks every replica, starting at a rotating one, whether it has
// replayed lsn; a replica that does not answer is not up to date.
func (g *gitlab) upToDate(ctx context.Context, lsn position.LSN) (namedPool, bool) {
	start := g.next.Add(1)
	for i := range g.replicas {
		r := g.replicas[(int(start)+i)%len(g.replicas)]
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		var ok bool
		err := r.pool.QueryRow(qctx, `SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)`, lsn.String()).Scan(&ok)
		cancel()
		if err == nil && ok {
			return r, true
		}
	}
	return namedPool{}, false
}

// window reads the primary for a fixed time after the write (the token's
// capture time) and any replica afterwards, as Rails' database selector
// does with its 2s delay: no position is compared.
type window struct {
	primary  *pgxpool.Pool
	replicas []namedPool
	next     atomic.Uint32
	for_     time.Duration
}

func (w *window) name() string { return "window" }

func (w *window) route(ctx context.Context, header string, retried bool) (choice, error) {
	tok, err := position.Decode(header)
	if err != nil || tok.CapturedAt.IsZero() || time.Since(tok.CapturedAt) < w.for_ {
		return choice{pool: w.primary, outcome: "primary_window"}, nil
	}
	r := w.replicas[int(w.next.Add(1))%len(w.replicas)]
	return choice{pool: r.pool, replica: r.name, outcome: "replica"}, nil
}

func headerLSN(header string) (position.LSN, bool) {
	tok, err := position.Decode(header)
	if err != nil {
		return 0, false
	}
	e, ok := tok.Entry("main")
	return e.LSN, ok
}

func baselineRead(ctx context.Context, b baseline, st *stream, p payload, header string, retried bool) error {
	c, err := b.route(ctx, header, retried)
	if err != nil {
		return err
	}
	return readRow(ctx, st, c.pool, read{job: p, replica: c.replica, outcome: c.outcome, reason: b.name()})
}

// startBaselineAsynq runs a plain asynq server (no caughtup hooks) whose
// handler routes with b. GitLab's retry through the queue is a failed
// attempt after retry, the same delay caughtup's first deferral has.
func (s *services) startBaselineAsynq(queue string, b baseline, st *stream, retry time.Duration) (*asynq.Server, error) {
	srv := asynq.NewServer(s.redisOpt(), s.asynqServerConfig(queue, asynqConcurrency, retry))
	mux := asynq.NewServeMux()
	mux.HandleFunc(taskType, func(ctx context.Context, t *asynq.Task) error {
		p, err := decodePayload(t.Payload())
		if err != nil {
			return fmt.Errorf("%w: %v", asynq.SkipRetry, err)
		}
		n, _ := asynq.GetRetryCount(ctx)
		err = baselineRead(ctx, b, st, p, t.Headers()[position.HeaderName], n > 0)
		classify(st, err)
		return err
	})
	if err := srv.Start(mux); err != nil {
		return nil, err
	}
	return srv, nil
}

func baselineKafkaHandler(b baseline, st *stream) caughtupkafka.Handler {
	return func(ctx context.Context, msg kafkago.Message) error {
		p, err := decodePayload(msg.Value)
		if err != nil {
			return nil
		}
		return baselineRead(ctx, b, st, p, tokenText(msg), caughtupkafka.Attempt(ctx) > 0)
	}
}
