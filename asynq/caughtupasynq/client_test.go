package caughtupasynq_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/position"
)

var testEpoch = position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}

func fakeToken(lsn position.LSN) position.Token {
	return position.New("main", testEpoch, lsn, position.SourcePrimary, time.Now())
}

func encode(t testing.TB, tok position.Token) string {
	t.Helper()
	s, err := tok.Encode()
	require.NoError(t, err)
	return s
}

// TestClientKeepsOptions enqueues stamped tasks through Redis and reads
// back, with asynq's Inspector, every option asynq stores, whether the
// options were given to NewTask, to EnqueueContext, or split between
// them: Queue, MaxRetry, Timeout, Deadline, Unique, TaskID, ProcessAt,
// ProcessIn, Retention and Group.
func TestClientKeepsOptions(t *testing.T) {
	t.Parallel()
	e := setupRedis(t)
	tok := fakeToken(0x16B3740)
	ctx := enqueue.WithToken(context.Background(), tok)
	deadline := time.Now().Add(3 * time.Hour).Truncate(time.Second)
	processAt := time.Now().Add(2 * time.Hour).Truncate(time.Second)

	// build returns the task and the enqueue options for opts placed one
	// way or the other.
	type build func(name string, payload []byte, headers map[string]string, opts []asynq.Option) (*asynq.Task, []asynq.Option)
	for _, p := range []struct {
		name  string
		build build
	}{
		{"AtNewTask", func(name string, payload []byte, h map[string]string, opts []asynq.Option) (*asynq.Task, []asynq.Option) {
			return caughtupasynq.NewTaskWithHeaders(ctx, name, payload, h, opts...), nil
		}},
		{"AtEnqueue", func(name string, payload []byte, h map[string]string, opts []asynq.Option) (*asynq.Task, []asynq.Option) {
			return caughtupasynq.NewTaskWithHeaders(context.Background(), name, payload, h), opts
		}},
		{"Split", func(name string, payload []byte, h map[string]string, opts []asynq.Option) (*asynq.Task, []asynq.Option) {
			half := len(opts) / 2
			return caughtupasynq.NewTaskWithHeaders(context.Background(), name, payload, h, opts[:half]...), opts[half:]
		}},
	} {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			typ := "opts:" + p.name
			id := queueName(t)
			scheduled := []asynq.Option{
				asynq.Queue(e.queue), asynq.MaxRetry(7), asynq.Timeout(42 * time.Second), asynq.Deadline(deadline),
				asynq.Unique(time.Hour), asynq.TaskID(id), asynq.ProcessAt(processAt), asynq.Retention(2 * time.Hour),
			}
			task, enq := p.build(typ, []byte("p1"), map[string]string{"trace": "abc"}, scheduled)
			info, err := e.client.EnqueueContext(ctx, task, enq...)
			require.NoError(t, err)
			got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
			require.NoError(t, err)
			require.Equal(t, id, got.ID, "TaskID")
			require.Equal(t, e.queue, got.Queue, "Queue")
			require.Equal(t, typ, got.Type)
			require.Equal(t, []byte("p1"), got.Payload)
			require.Equal(t, asynq.TaskStateScheduled, got.State)
			require.Equal(t, processAt, got.NextProcessAt, "ProcessAt")
			require.Equal(t, 7, got.MaxRetry, "MaxRetry")
			require.Equal(t, 42*time.Second, got.Timeout, "Timeout")
			require.Equal(t, deadline, got.Deadline, "Deadline")
			require.Equal(t, 2*time.Hour, got.Retention, "Retention")
			require.Equal(t, map[string]string{
				"trace":                      "abc",
				position.HeaderName:          encode(t, tok),
				caughtupasynq.HeaderDedup:    "1",
				caughtupasynq.HeaderDeadline: strconv.FormatInt(deadline.Unix(), 10),
			}, got.Headers)
			// Unique: the same type and payload again, under another id.
			again, enq := p.build(typ, []byte("p1"), nil, append(scheduled[:5:5], asynq.TaskID(id+"-again")))
			_, err = e.client.EnqueueContext(ctx, again, enq...)
			require.ErrorIs(t, err, asynq.ErrDuplicateTask, "Unique")

			task, enq = p.build(typ, []byte("p2"), nil, []asynq.Option{asynq.Queue(e.queue), asynq.ProcessIn(90 * time.Minute), asynq.MaxRetry(2)})
			before := time.Now()
			info, err = e.client.EnqueueContext(ctx, task, enq...)
			require.NoError(t, err)
			got, err = e.inspector.GetTaskInfo(e.queue, info.ID)
			require.NoError(t, err)
			require.Equal(t, asynq.TaskStateScheduled, got.State)
			require.WithinRange(t, got.NextProcessAt, before.Add(90*time.Minute-time.Second), time.Now().Add(90*time.Minute+time.Second), "ProcessIn")
			require.Equal(t, 2, got.MaxRetry)
			require.Equal(t, 30*time.Minute, got.Timeout, "asynq's default timeout")
			require.Equal(t, "0", got.Headers[caughtupasynq.HeaderDeadline], "no Deadline")

			group := "g-" + p.name
			task, enq = p.build(typ, []byte("p3"), nil, []asynq.Option{asynq.Queue(e.queue), asynq.Group(group), asynq.Timeout(time.Minute), asynq.Retention(time.Hour)})
			info, err = e.client.EnqueueContext(ctx, task, enq...)
			require.NoError(t, err)
			got, err = e.inspector.GetTaskInfo(e.queue, info.ID)
			require.NoError(t, err)
			require.Equal(t, asynq.TaskStateAggregating, got.State)
			require.Equal(t, group, got.Group, "Group")
			require.Equal(t, time.Minute, got.Timeout)
			require.Equal(t, time.Hour, got.Retention)
			require.Equal(t, encode(t, tok), got.Headers[position.HeaderName])
		})
	}
}

// TestClientRefusesForeignTasks: a task from asynq.NewTask that needs a
// token is refused at the call, and nothing is enqueued; one that needs
// nothing goes through untouched.
func TestClientRefusesForeignTasks(t *testing.T) {
	t.Parallel()
	e := setupRedis(t)
	ctx := enqueue.WithToken(context.Background(), fakeToken(0x1000))

	_, err := e.client.EnqueueContext(ctx, asynq.NewTask("foreign", nil, asynq.MaxRetry(3)), asynq.Queue(e.queue))
	require.ErrorIs(t, err, caughtupasynq.ErrForeignTask)
	require.ErrorContains(t, err, "caughtupasynq.NewTask")
	_, err = e.client.EnqueueContext(ctx, asynq.NewTaskWithHeaders("foreign", nil, map[string]string{"a": "b"}), asynq.Queue(e.queue))
	require.ErrorIs(t, err, caughtupasynq.ErrForeignTask)
	queues, err := e.inspector.Queues()
	require.NoError(t, err)
	require.NotContains(t, queues, e.queue, "nothing was enqueued")

	// No token: nothing to add, so asynq's own task goes as it is, with
	// its options; the consumer reads the primary for it.
	info, err := e.client.EnqueueContext(context.Background(), asynq.NewTask("foreign", nil, asynq.MaxRetry(3), asynq.Queue(e.queue), asynq.ProcessIn(time.Hour)))
	require.NoError(t, err)
	got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Empty(t, got.Headers)
	require.Equal(t, 3, got.MaxRetry)

	// An explicit token, merged with the header's.
	tok, higher := fakeToken(0x1000), fakeToken(0x20000000)
	task := caughtupasynq.NewTaskWithHeaders(context.Background(), "explicit", nil, map[string]string{position.HeaderName: encode(t, higher)})
	info, err = e.client.EnqueueToken(context.Background(), tok, task, asynq.Queue(e.queue), asynq.ProcessIn(time.Hour))
	require.NoError(t, err)
	got, err = e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Equal(t, encode(t, higher.Merge(tok)), got.Headers[position.HeaderName])

	_, err = e.client.EnqueueContext(ctx, nil)
	require.Error(t, err)
}

// TestClientDedupMarker: unique and TaskID tasks carry HeaderDedup, and
// asynq's duplicate errors come back unchanged.
func TestClientDedupMarker(t *testing.T) {
	t.Parallel()
	e := setupRedis(t)
	ctx := enqueue.WithToken(context.Background(), fakeToken(0x1000))
	bg := context.Background()

	info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(bg, "dedup:unique", []byte("u"), asynq.Unique(time.Hour)),
		asynq.Queue(e.queue), asynq.ProcessIn(time.Hour))
	require.NoError(t, err)
	got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Equal(t, "1", got.Headers[caughtupasynq.HeaderDedup])
	_, err = e.client.EnqueueContext(ctx, caughtupasynq.NewTask(bg, "dedup:unique", []byte("u"), asynq.Unique(time.Hour)),
		asynq.Queue(e.queue), asynq.ProcessIn(time.Hour))
	require.ErrorIs(t, err, asynq.ErrDuplicateTask)

	id := queueName(t)
	info, err = e.client.EnqueueContext(bg, caughtupasynq.NewTask(bg, "dedup:id", nil),
		asynq.Queue(e.queue), asynq.TaskID(id), asynq.ProcessIn(time.Hour))
	require.NoError(t, err)
	got, err = e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Equal(t, map[string]string{caughtupasynq.HeaderDedup: "1"}, got.Headers, "marked even without a token")
	_, err = e.client.EnqueueContext(ctx, caughtupasynq.NewTask(bg, "dedup:id", nil),
		asynq.Queue(e.queue), asynq.TaskID(id), asynq.ProcessIn(time.Hour))
	require.ErrorIs(t, err, asynq.ErrTaskIDConflict)
}
