package outbox

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/internal/pgtest"
	"github.com/caughtup/caughtup/position"
)

func TestKafkaPublisher(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "orders"))
	require.NoError(t, err)
	defer kc.Close()
	transport := &kafka.Transport{}
	defer transport.CloseIdleConnections()

	_, err = NewKafkaPublisher(&kafka.Writer{Addr: kafka.TCP(kc.ListenAddrs()...)})
	require.ErrorIs(t, err, ErrUnsafeWriter, "RequireNone is kafka-go's default")
	_, err = NewKafkaPublisher(&kafka.Writer{Addr: kafka.TCP(kc.ListenAddrs()...), RequiredAcks: kafka.RequireAll, Async: true})
	require.ErrorIs(t, err, ErrUnsafeWriter)

	w := &kafka.Writer{Addr: kafka.TCP(kc.ListenAddrs()...), Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll,
		BatchTimeout: time.Millisecond, Transport: transport}
	defer func() { _ = w.Close() }()
	pub, err := NewKafkaPublisher(w)
	require.NoError(t, err)
	ids := e.writeOrders(t, ctx, 1, 12)
	r, err := NewPollingRelay(PollingConfig{DB: e.primary, Publisher: pub, Logger: quiet})
	require.NoError(t, err)
	n, err := r.RelayOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 12, n)

	seen := map[string]bool{}
	for p := range 2 {
		rd := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.ListenAddrs(), Topic: "orders", Partition: p, MaxWait: 50 * time.Millisecond,
			Dialer: &kafka.Dialer{Timeout: 5 * time.Second}})
		for {
			rctx, rcancel := context.WithTimeout(ctx, 500*time.Millisecond)
			m, err := rd.ReadMessage(rctx)
			rcancel()
			if errors.Is(err, context.DeadlineExceeded) {
				break
			}
			require.NoError(t, err)
			h := map[string]string{}
			for _, x := range m.Headers {
				h[x.Key] = string(x.Value)
			}
			require.Equal(t, string(m.Key), h["order"], "key = Event.Key, producer headers kept")
			require.Equal(t, string(m.Key), string(m.Value))
			tok, err := TokenFromKafkaHeaders(m.Headers)
			require.NoError(t, err)
			entry, ok := tok.Entry("main")
			require.True(t, ok)
			require.Equal(t, position.SourcePrimary, entry.Source)
			seen[h[HeaderEventID]] = true
		}
		require.NoError(t, rd.Close())
	}
	for _, id := range ids {
		require.True(t, seen[id], "event %s not in Kafka", id)
	}
}

func TestAsynqPublisherDedupesByEventID(t *testing.T) {
	t.Parallel()
	redis := pgtest.SharedRedis(t)
	opt := asynq.RedisClientOpt{Addr: redis.Addr(), DB: 3}
	client := asynq.NewClient(opt)
	defer func() { _ = client.Close() }()
	insp := asynq.NewInspector(opt)
	defer func() { _ = insp.Close() }()
	queue := "outbox_test"
	pub, err := NewAsynqPublisher(client, asynq.Queue(queue))
	require.NoError(t, err)
	tok := position.New("main", position.Epoch{SystemID: 7, Timeline: 1}, 0x16B3740, position.SourceCDC, time.Now())
	events := []Event{
		stamp(Event{ID: newUUID(), Topic: "email:send", Payload: []byte(`{"to":"a"}`), Headers: map[string]string{"x": "1"}}, tok),
		stamp(Event{ID: newUUID(), Topic: "email:send", Payload: []byte(`{"to":"b"}`)}, tok),
	}
	ctx := context.Background()
	require.NoError(t, pub.Publish(ctx, events))
	require.NoError(t, pub.Publish(ctx, events), "a republished batch is not an error")
	tasks, err := insp.ListPendingTasks(queue)
	require.NoError(t, err)
	require.Len(t, tasks, 2, "TaskID = event ID dedupes the second publish")
	for _, ti := range tasks {
		require.Equal(t, "email:send", ti.Type)
		got, err := TokenFromHeaders(ti.Headers)
		require.NoError(t, err)
		require.Equal(t, tok.Entries, got.Entries)
		require.Equal(t, ti.ID, ti.Headers[HeaderEventID])
	}
	_, err = insp.DeleteAllPendingTasks(queue)
	require.NoError(t, err)
}

func TestStamp(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var got []Event
	next := func(_ context.Context, ev Event) error { got = append(got, ev); return nil }

	// A token in the context wins and needs no database.
	ctxTok := position.New("main", position.Epoch{SystemID: 7, Timeline: 1}, 0x100, position.SourcePrimary, time.Now())
	require.NoError(t, Stamp(next)(enqueue.WithToken(ctx, ctxTok), Event{ID: "a", Topic: "t"}))
	require.Equal(t, ctxTok.Entries, got[0].Token.Entries)
	require.Equal(t, "a", got[0].Headers[HeaderEventID])

	// No token, no capture: published unstamped (consumers read the
	// primary); StampRequired refuses instead.
	require.NoError(t, Stamp(next)(ctx, Event{ID: "b", Topic: "t"}))
	require.NotContains(t, got[1].Headers, position.HeaderName)
	require.ErrorIs(t, Stamp(next, StampRequired())(ctx, Event{ID: "c"}), ErrNoToken)
	boom := errors.New("boom")
	err := Stamp(next, StampRequired(), WithCapture(func(context.Context) (position.Token, error) { return position.Token{}, boom }))(ctx, Event{ID: "c"})
	require.ErrorIs(t, err, ErrNoToken)
	require.ErrorIs(t, err, boom)
	require.Len(t, got, 2)

	// Captured on demand, after the row was committed: at or past its
	// commit, and merged with the token the event already had.
	_, after, err := e.writeOrder(ctx, 1)
	require.NoError(t, err)
	other, _ := position.New("billing", position.Epoch{SystemID: 9, Timeline: 1}, 5, position.SourcePrimary, time.Now()).Encode()
	legacy := Stamp(next, WithCapture(CaptureFrom(e.primary, e.capturer)))
	require.NoError(t, legacy(ctx, Event{ID: "d", Topic: "t", Headers: map[string]string{position.HeaderName: other}}))
	tok, err := TokenFromHeaders(got[2].Headers)
	require.NoError(t, err)
	main, ok := tok.Entry("main")
	require.True(t, ok)
	require.GreaterOrEqual(t, main.LSN, after)
	_, ok = tok.Entry("billing")
	require.True(t, ok)
}
