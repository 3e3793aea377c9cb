package asynq_test

import (
	"context"
	"testing"
	"time"

	hasynq "github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	caughtupasynq "github.com/caughtup/caughtup/asynq"
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

// TestClientKeepsOptions enqueues through Redis and reads back what asynq
// stored: the stamped header and every option, whether given to NewTask or
// to EnqueueContext.
func TestClientKeepsOptions(t *testing.T) {
	t.Parallel()
	e := setupRedis(t)
	tok := fakeToken(0x16B3740)
	ctx := enqueue.WithToken(context.Background(), tok)

	task := hasynq.NewTask("opts:new-task", []byte("p1"),
		hasynq.Queue(e.queue), hasynq.MaxRetry(7), hasynq.Timeout(42*time.Second),
		hasynq.Retention(time.Hour), hasynq.ProcessIn(time.Hour))
	info, err := e.client.EnqueueContext(ctx, task)
	require.NoError(t, err)
	got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Equal(t, hasynq.TaskStateScheduled, got.State)
	require.Equal(t, 7, got.MaxRetry)
	require.Equal(t, 42*time.Second, got.Timeout)
	require.Equal(t, time.Hour, got.Retention)
	require.Equal(t, []byte("p1"), got.Payload)
	require.Equal(t, encode(t, tok), got.Headers[position.HeaderName])
	require.NotContains(t, got.Headers, caughtupasynq.HeaderDedup)
	require.Nil(t, task.Headers(), "the caller's task is untouched")

	// Options at enqueue override the task's, as in asynq; the caller's
	// other headers stay.
	task = hasynq.NewTaskWithHeaders("opts:with-headers", []byte("p2"), map[string]string{"trace": "abc"},
		hasynq.Queue("elsewhere"), hasynq.MaxRetry(1))
	info, err = e.client.EnqueueContext(ctx, task, hasynq.Queue(e.queue), hasynq.MaxRetry(3), hasynq.ProcessIn(time.Hour))
	require.NoError(t, err)
	got, err = e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Equal(t, 3, got.MaxRetry)
	require.Equal(t, map[string]string{"trace": "abc", position.HeaderName: encode(t, tok)}, got.Headers)
	require.Equal(t, map[string]string{"trace": "abc"}, task.Headers())

	// No token: the task goes as it is, and the consumer reads the primary.
	info, err = e.client.EnqueueContext(context.Background(), hasynq.NewTask("opts:none", nil, hasynq.Queue(e.queue), hasynq.ProcessIn(time.Hour)))
	require.NoError(t, err)
	got, err = e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Empty(t, got.Headers)

	// An explicit token, merged with the header's.
	higher := fakeToken(0x20000000)
	task = hasynq.NewTaskWithHeaders("opts:explicit", nil, map[string]string{position.HeaderName: encode(t, higher)})
	info, err = e.client.EnqueueToken(context.Background(), tok, task, hasynq.Queue(e.queue), hasynq.ProcessIn(time.Hour))
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

	info, err := e.client.EnqueueContext(ctx, hasynq.NewTask("dedup:unique", []byte("u"), hasynq.Unique(time.Hour)),
		hasynq.Queue(e.queue), hasynq.ProcessIn(time.Hour))
	require.NoError(t, err)
	got, err := e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Equal(t, "1", got.Headers[caughtupasynq.HeaderDedup])
	_, err = e.client.EnqueueContext(ctx, hasynq.NewTask("dedup:unique", []byte("u"), hasynq.Unique(time.Hour)),
		hasynq.Queue(e.queue), hasynq.ProcessIn(time.Hour))
	require.ErrorIs(t, err, hasynq.ErrDuplicateTask)

	info, err = e.client.EnqueueContext(context.Background(), hasynq.NewTask("dedup:id", nil),
		hasynq.Queue(e.queue), hasynq.TaskID("fixed-id"), hasynq.ProcessIn(time.Hour))
	require.NoError(t, err)
	got, err = e.inspector.GetTaskInfo(e.queue, info.ID)
	require.NoError(t, err)
	require.Equal(t, map[string]string{caughtupasynq.HeaderDedup: "1"}, got.Headers, "marked even without a token")
	_, err = e.client.EnqueueContext(ctx, hasynq.NewTask("dedup:id", nil),
		hasynq.Queue(e.queue), hasynq.TaskID("fixed-id"), hasynq.ProcessIn(time.Hour))
	require.ErrorIs(t, err, hasynq.ErrTaskIDConflict)
}
