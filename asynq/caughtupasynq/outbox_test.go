package caughtupasynq_test

import (
	"context"
	"log"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/outbox"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// TestOutboxPublisherDedupesByEventID: a batch the relay publishes twice
// (a crash between the enqueue and the mark) enqueues each task once,
// with the relay's token and the event ID in its headers.
func TestOutboxPublisherDedupesByEventID(t *testing.T) {
	t.Parallel()
	redis := pgtest.SharedRedis(t)
	opt := asynq.RedisClientOpt{Addr: redis.Addr(), DB: 3}
	client := asynq.NewClient(opt)
	defer func() { _ = client.Close() }()
	insp := asynq.NewInspector(opt)
	defer func() { _ = insp.Close() }()
	const queue = "outbox_publisher_test"
	pub, err := caughtupasynq.NewOutboxPublisher(client, asynq.Queue(queue))
	require.NoError(t, err)
	_, err = caughtupasynq.NewOutboxPublisher(nil)
	require.Error(t, err)

	tok := position.New("main", position.Epoch{SystemID: 7, Timeline: 1}, 0x16B3740, position.SourceCDC, time.Now())
	enc, err := tok.Encode()
	require.NoError(t, err)
	// Events as a relay hands them over: stamped, with their ID header.
	events := []outbox.Event{
		{ID: "3f1c2a52-0000-4000-8000-000000000001", Topic: "email:send", Payload: []byte(`{"to":"a"}`),
			Headers: map[string]string{"x": "1", position.HeaderName: enc, outbox.HeaderEventID: "3f1c2a52-0000-4000-8000-000000000001"}},
		{ID: "3f1c2a52-0000-4000-8000-000000000002", Topic: "email:send", Payload: []byte(`{"to":"b"}`),
			Headers: map[string]string{position.HeaderName: enc, outbox.HeaderEventID: "3f1c2a52-0000-4000-8000-000000000002"}},
	}
	ctx := context.Background()
	require.NoError(t, pub.Publish(ctx, events))
	require.NoError(t, pub.Publish(ctx, events), "a republished batch is not an error")
	tasks, err := insp.ListPendingTasks(queue)
	require.NoError(t, err)
	require.Len(t, tasks, 2, "TaskID = event ID dedupes the second publish")
	for _, ti := range tasks {
		require.Equal(t, "email:send", ti.Type)
		got, err := outbox.TokenFromHeaders(ti.Headers)
		require.NoError(t, err)
		require.Equal(t, tok.Entries, got.Entries)
		require.Equal(t, ti.ID, ti.Headers[outbox.HeaderEventID])
	}
	_, err = insp.DeleteAllPendingTasks(queue)
	require.NoError(t, err)
}

// A relay process that enqueues outbox events as asynq tasks; completed
// tasks are kept a day so that a republished event is still deduplicated.
// (Needs a database and Redis, so it is compiled but not run.)
func ExampleNewOutboxPublisher() {
	ctx := context.Background()
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: "localhost:6379"})
	defer func() { _ = client.Close() }()
	pub, err := caughtupasynq.NewOutboxPublisher(client, asynq.Retention(24*time.Hour))
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.NewLogicalRelay(outbox.LogicalConfig{ConnString: "postgres://relay@primary/shop", Publisher: pub})
	if err != nil {
		log.Fatal(err)
	}
	_ = relay.Run(ctx) // until ctx is done
}
