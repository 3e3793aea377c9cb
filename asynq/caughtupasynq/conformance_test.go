package caughtupasynq_test

import (
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/conformance"
)

// driver runs the conformance suite through asynq: NewTask and the
// stamping Client, NewServer, on its own queue of the shared redis-server.
type driver struct {
	t *testing.T
	*redisEnv
}

var (
	_ conformance.Driver            = (*driver)(nil)
	_ conformance.RetryCounter      = (*driver)(nil)
	_ conformance.DeadLetterCounter = (*driver)(nil)
)

const conformanceType = "conformance:job"

func jobPayload(job conformance.Job) []byte {
	return []byte(strconv.FormatInt(job.ID, 10) + ":" + job.Key)
}

func (d *driver) Produce(ctx context.Context, job conformance.Job) error {
	_, err := d.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, conformanceType, jobPayload(job)), asynq.Queue(d.queue))
	return err
}

func (d *driver) ProduceRaw(ctx context.Context, job conformance.Job, header string) error {
	var h map[string]string
	if header != "" {
		h = map[string]string{position.HeaderName: header}
	}
	_, err := d.raw.EnqueueContext(ctx, asynq.NewTaskWithHeaders(conformanceType, jobPayload(job), h), asynq.Queue(d.queue))
	return err
}

func (d *driver) Consume(ctx context.Context, router *consume.Router, policy consume.Policy, handle conformance.Handler) (func() error, error) {
	mux := asynq.NewServeMux()
	mux.HandleFunc(conformanceType, func(ctx context.Context, task *asynq.Task) error {
		id, key, ok := strings.Cut(string(task.Payload()), ":")
		n, err := strconv.ParseInt(id, 10, 64)
		if !ok || err != nil {
			return errors.Join(asynq.SkipRetry, err)
		}
		return handle(ctx, conformance.Job{ID: n, Key: key})
	})
	// A real handler error (in the balanced scenario, connections that
	// kept reaching the paused standby) is retried soon, as the chaos lab
	// retries them: asynq's default delay (15s to 45s for the first retry)
	// would make a scenario's length depend on whether one happened.
	// Deferrals keep the router's delays (ServerConfig).
	cfg := d.serverConfig(asynq.Config{Concurrency: 32, RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 200 * time.Millisecond }})
	srv, err := caughtupasynq.NewServer(d.opt, cfg, router,
		caughtupasynq.MiddlewareConfig{DefaultPolicy: policy})
	if err != nil {
		return nil, err
	}
	if err := srv.Start(mux); err != nil {
		return nil, err
	}
	return func() error { srv.Shutdown(); return nil }, nil
}

func (d *driver) RetryCount(ctx context.Context) int {
	n, _ := asynq.GetRetryCount(ctx)
	return n
}

// DeadLettered is how many of the queue's tasks asynq archived.
func (d *driver) DeadLettered(context.Context) (int, error) {
	info, err := d.inspector.GetQueueInfo(d.queue)
	if err != nil {
		return 0, err
	}
	return info.Archived, nil
}

// TestConformance runs the freshness suite. The fresh-reads scenario has
// 10,000 jobs (1,000 with -short); CAUGHTUP_CONFORMANCE_JOBS overrides.
func TestConformance(t *testing.T) {
	jobs := 10000
	if testing.Short() {
		jobs = 1000
	}
	if v := os.Getenv("CAUGHTUP_CONFORMANCE_JOBS"); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err)
		jobs = n
	}
	conformance.Run(t, conformance.Config{
		NewDriver: func(t *testing.T) conformance.Driver { return &driver{t: t, redisEnv: setupRedis(t)} },
		Jobs:      jobs,
	})
}
