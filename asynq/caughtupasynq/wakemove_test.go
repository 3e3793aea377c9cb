package caughtupasynq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/metrictest"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// TestWakeMoveScript checks wakeMoveScript against tasks that a real
// asynq server left in each state: it moves a retry task whose retry
// count is the one given, and nothing else.
func TestWakeMoveScript(t *testing.T) {
	t.Parallel()
	r := pgtest.SharedRedis(t)
	opt := asynq.RedisClientOpt{Addr: r.Addr()}
	c := redis.NewClient(&redis.Options{Addr: r.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	insp := asynq.NewInspector(opt)
	t.Cleanup(func() { _ = insp.Close() })
	client := asynq.NewClient(opt)
	t.Cleanup(func() { _ = client.Close() })
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	queue := "wake_move_" + hex.EncodeToString(b)

	errDefer, errFail := errors.New("defer"), errors.New("fail")
	srv := asynq.NewServer(opt, asynq.Config{
		Concurrency: 4, Queues: map[string]int{queue: 1}, LogLevel: asynq.FatalLevel,
		DelayedTaskCheckInterval: time.Hour, TaskCheckInterval: 10 * time.Millisecond,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour },
		// A deferral keeps the retry count, a failure raises it.
		IsFailure: func(err error) bool { return !errors.Is(err, errDefer) },
	})
	require.NoError(t, srv.Start(asynq.HandlerFunc(func(_ context.Context, task *asynq.Task) error {
		switch string(task.Payload()) {
		case "defer":
			return errDefer
		case "fail":
			return errFail
		}
		return nil
	})))
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			srv.Shutdown()
		}
	}
	t.Cleanup(stop)
	enqueue := func(payload string, opts ...asynq.Option) string {
		info, err := client.Enqueue(asynq.NewTask("t", []byte(payload)), append([]asynq.Option{asynq.Queue(queue), asynq.MaxRetry(10)}, opts...)...)
		require.NoError(t, err)
		return info.ID
	}
	deferred := enqueue("defer")
	failed := enqueue("fail")
	archived := enqueue("fail", asynq.MaxRetry(0))
	completed := enqueue("ok", asynq.Retention(time.Hour))
	scheduled := enqueue("ok", asynq.ProcessIn(time.Hour))
	want := map[string]asynq.TaskState{deferred: asynq.TaskStateRetry, failed: asynq.TaskStateRetry,
		archived: asynq.TaskStateArchived, completed: asynq.TaskStateCompleted, scheduled: asynq.TaskStateScheduled}
	require.Eventually(t, func() bool {
		for id, st := range want {
			if info, err := insp.GetTaskInfo(queue, id); err != nil || info.State != st {
				return false
			}
		}
		return true
	}, 20*time.Second, 10*time.Millisecond, "the tasks never reached their states")
	stop()
	pending := enqueue("ok")
	info, err := insp.GetTaskInfo(queue, failed)
	require.NoError(t, err)
	require.Equal(t, 1, info.Retried)
	info, err = insp.GetTaskInfo(queue, deferred)
	require.NoError(t, err)
	require.Equal(t, 0, info.Retried)

	entry := func(id string, retried int) *wakeEntry {
		return &wakeEntry{Key: taskKey{queue: queue, id: id}, Data: wakeTask{retried: retried}}
	}
	ctx := context.Background()
	got := moveBatch(ctx, c, queue, []*wakeEntry{
		entry(deferred, 0), entry(failed, 0), entry(archived, 0), entry(completed, 0),
		entry(scheduled, 0), entry(pending, 0), entry("no-such-task", 0),
	})
	require.Equal(t, []attemptResult{
		{woken: true},
		{err: wakeChanged}, // failed since: its retry count is 1
		{err: wakeFinished},
		{err: wakeFinished},
		{err: wakeChanged},
		{err: wakePending},
		{err: wakeNotFound},
	}, got)
	states := map[string]asynq.TaskState{deferred: asynq.TaskStatePending, failed: asynq.TaskStateRetry,
		archived: asynq.TaskStateArchived, completed: asynq.TaskStateCompleted, scheduled: asynq.TaskStateScheduled,
		pending: asynq.TaskStatePending}
	for id, st := range states {
		info, err := insp.GetTaskInfo(queue, id)
		require.NoError(t, err)
		require.Equal(t, st, info.State, "task %s", id)
	}
	qi, err := insp.GetQueueInfo(queue)
	require.NoError(t, err)
	require.Equal(t, 2, qi.Pending, "the moved task and the pending one")
	require.Equal(t, 1, qi.Retry, "the failed task stays in the retry set")

	// Through a waker that moves by script, under a router whose replica
	// has replayed both tokens: the count the failure left matches, so
	// the task is moved, once; both are forgotten.
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	w, err := newWaker(caughtUpRouter{}, insp, c, 10, mp, tracenoop.NewTracerProvider().Tracer(""), slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	for _, e := range []*wakeEntry{entry(failed, 1), entry(deferred, 0)} {
		e.Token = tokenAt("main", 1, wt0)
		e.Expires = time.Now().Add(time.Hour)
		require.True(t, w.Remember(ctx, e, trace.SpanContext{}))
	}
	require.Eventually(t, func() bool { return w.Len() == 0 }, 30*time.Second, 10*time.Millisecond, "both forgotten")
	w.close() // waits for the move in flight to be counted
	require.Equal(t, int64(1), metrictest.Sum(t, reader, "caughtup.asynq.wake.tasks"))
	require.Equal(t, int64(1), metrictest.Sum(t, reader, "caughtup.asynq.wake.errors", attribute.String("error.type", "pending")))
	qi, err = insp.GetQueueInfo(queue)
	require.NoError(t, err)
	require.Equal(t, 3, qi.Pending)
	require.Zero(t, qi.Retry)

	// A Redis that cannot answer: every task is tried again later.
	closed := redis.NewClient(&redis.Options{Addr: r.Addr()})
	require.NoError(t, closed.Close())
	for _, r := range moveBatch(ctx, closed, queue, []*wakeEntry{entry(failed, 1)}) {
		require.Equal(t, wakeRedis, r.err)
		require.True(t, r.retry)
		require.Error(t, r.cause)
	}
}

// caughtUpRouter is a router whose one replica of "main", fresh at wt0
// (its clock), has replayed LSN 10.
type caughtUpRouter struct{}

func (caughtUpRouter) Snapshot() *replay.Snapshot {
	return &replay.Snapshot{Databases: []replay.DatabaseState{{
		Name:    "main",
		Primary: replay.PrimaryState{Epoch: epoch, HistoryKnown: true, InsertLSN: 1 << 40, ObservedAt: wt0},
		Replicas: []replay.ReplicaState{{
			Name: "r1", Replayed: position.Replayed{Epoch: epoch, LSN: 10},
			InRecovery: true, Healthy: true, ObservedAt: wt0, Observations: 1,
		}},
	}}}
}

func (caughtUpRouter) Watch(position.Token) func() { return func() {} }

func (caughtUpRouter) Config() consume.Config {
	return consume.Config{Now: func() time.Time { return wt0 }}.WithDefaults()
}
