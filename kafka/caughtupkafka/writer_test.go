package caughtupkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
)

// captureWriter records what it is asked to write.
type captureWriter struct {
	got []kafka.Message
	err error
}

func (w *captureWriter) WriteMessages(_ context.Context, msgs ...kafka.Message) error {
	w.got = append(w.got, msgs...)
	return w.err
}

var epoch = position.Epoch{SystemID: 0x6f1e2d3c4b5a6978, Timeline: 1}

func tokenAt(lsn string, db ...string) position.Token {
	name := "main"
	if len(db) > 0 {
		name = db[0]
	}
	return position.New(name, epoch, position.MustParseLSN(lsn), position.SourcePrimary, time.UnixMilli(1_700_000_000_000))
}

func tokenHeaders(msg kafka.Message) []string {
	var out []string
	for _, h := range msg.Headers {
		if h.Key == position.HeaderName {
			out = append(out, string(h.Value))
		}
	}
	return out
}

func decoded(t *testing.T, s string) position.Token {
	t.Helper()
	tok, err := position.Decode(s)
	require.NoError(t, err)
	return tok
}

func TestWriterStampsTheContextsToken(t *testing.T) {
	t.Parallel()
	tok := tokenAt("0/16B3740")
	ctx := enqueue.WithToken(context.Background(), tok)
	var cw captureWriter
	in := []kafka.Message{
		{Key: []byte("a"), Value: []byte("1"), Headers: []kafka.Header{{Key: "trace", Value: []byte("x")}}},
		{Key: []byte("b"), Value: []byte("2")},
	}
	require.NoError(t, caughtupkafka.NewWriter(&cw).WriteMessages(ctx, in...))
	require.Len(t, cw.got, 2)
	want, err := tok.Encode()
	require.NoError(t, err)
	for _, m := range cw.got {
		require.Equal(t, []string{want}, tokenHeaders(m))
	}
	require.Equal(t, "trace", cw.got[0].Headers[0].Key, "other headers are kept")
	require.Len(t, in[0].Headers, 1, "the caller's messages are not modified")
	require.Empty(t, in[1].Headers)
}

func TestWriterWithoutTokenWritesNoHeader(t *testing.T) {
	t.Parallel()
	var cw captureWriter
	cw.err = errors.New("broker down")
	err := caughtupkafka.NewWriter(&cw).WriteMessages(context.Background(), kafka.Message{Value: []byte("1")})
	require.EqualError(t, err, "broker down", "the wrapped writer's error is returned as is")
	require.Empty(t, tokenHeaders(cw.got[0]))
}

func TestStampMergesAnExistingToken(t *testing.T) {
	t.Parallel()
	ctx := enqueue.WithToken(context.Background(), tokenAt("0/1000"))
	older, _ := tokenAt("0/2000").Encode()
	other, _ := tokenAt("1/0", "billing").Encode()
	msg := kafka.Message{Headers: []kafka.Header{
		{Key: position.HeaderName, Value: []byte(older)},
		{Key: "x", Value: []byte("y")},
		{Key: position.HeaderName, Value: []byte(other)},
	}}
	shared := msg.Headers
	require.NoError(t, caughtupkafka.Stamp(ctx, &msg))
	hs := tokenHeaders(msg)
	require.Len(t, hs, 1, "duplicate token headers are folded into one")
	got := decoded(t, hs[0])
	main, _ := got.Entry("main")
	require.Equal(t, position.MustParseLSN("0/2000"), main.LSN, "the furthest position wins")
	billing, ok := got.Entry("billing")
	require.True(t, ok)
	require.Equal(t, position.MustParseLSN("1/0"), billing.LSN)
	require.Equal(t, older, string(shared[0].Value), "a shared header slice is not modified")
}

func TestStampKeepsAnUnreadableToken(t *testing.T) {
	t.Parallel()
	ctx := enqueue.WithToken(context.Background(), tokenAt("0/1000"))
	good, _ := tokenAt("0/2000").Encode()
	for name, hs := range map[string][]string{
		"alone":           {"v9;from-the-future"},
		"among others":    {good, "v9;from-the-future", good},
		"with empty ones": {"", "v9;from-the-future", ""},
	} {
		msg := kafka.Message{Headers: []kafka.Header{{Key: "x", Value: []byte("y")}}}
		for _, v := range hs {
			msg.Headers = append(msg.Headers, kafka.Header{Key: position.HeaderName, Value: []byte(v)})
		}
		require.NoError(t, caughtupkafka.Stamp(ctx, &msg), name)
		require.Equal(t, []string{"v9;from-the-future"}, tokenHeaders(msg),
			"%s: the unreadable token stays, alone, so that the consumer reads the primary", name)
		require.Equal(t, "x", msg.Headers[0].Key, "%s: other headers are kept", name)
		_, err := caughtupkafka.TokenOf(msg)
		var de *position.DecodeError
		require.ErrorAs(t, err, &de, name)
	}
}

// manyDatabases is a token naming n databases, db0 … db<n-1>.
func manyDatabases(n int) position.Token {
	var tok position.Token
	for i := range n {
		tok = tok.Merge(tokenAt("0/1000", fmt.Sprintf("db%d", i)))
	}
	return tok
}

func TestStampRefusesAMergeTooLargeToCarry(t *testing.T) {
	t.Parallel()
	ctx := enqueue.WithToken(context.Background(), tokenAt("0/1000", "extra"))
	full, err := manyDatabases(position.MaxDatabases).Encode()
	require.NoError(t, err)
	msg := kafka.Message{Headers: []kafka.Header{{Key: position.HeaderName, Value: []byte(full)}}}
	err = caughtupkafka.Stamp(ctx, &msg)
	require.ErrorIs(t, err, position.ErrTooLarge, "a merge too large is an error at the call, not a dropped header")
	require.Equal(t, []string{full}, tokenHeaders(msg), "a message that cannot be stamped is left as it was")

	// Several headers that only together name too many databases.
	half, err := manyDatabases(position.MaxDatabases / 2).Encode()
	require.NoError(t, err)
	var others position.Token
	for i := range position.MaxDatabases/2 + 1 {
		others = others.Merge(tokenAt("0/1000", fmt.Sprintf("other%d", i)))
	}
	rest, err := others.Encode()
	require.NoError(t, err)
	msg = kafka.Message{Headers: []kafka.Header{{Key: position.HeaderName, Value: []byte(half)}, {Key: position.HeaderName, Value: []byte(rest)}}}
	require.ErrorIs(t, caughtupkafka.Stamp(ctx, &msg), position.ErrTooLarge)

	// The Writer writes nothing when one message cannot be stamped.
	var cw captureWriter
	err = caughtupkafka.NewWriter(&cw).WriteMessages(ctx, kafka.Message{Value: []byte("fine")},
		kafka.Message{Value: []byte("too large"), Headers: []kafka.Header{{Key: position.HeaderName, Value: []byte(full)}}})
	require.ErrorIs(t, err, position.ErrTooLarge)
	require.ErrorContains(t, err, "message 1")
	require.Empty(t, cw.got)
}

func TestStampedLeavesMessagesAloneWithoutToken(t *testing.T) {
	t.Parallel()
	in := []kafka.Message{{Value: []byte("1")}}
	out, err := caughtupkafka.Stamped(context.Background(), in)
	require.NoError(t, err)
	require.Equal(t, in, out)
}

func TestTokenOf(t *testing.T) {
	t.Parallel()
	a, _ := tokenAt("0/1000").Encode()
	b, _ := tokenAt("0/3000").Encode()
	billing, _ := tokenAt("2/0", "billing").Encode()
	header := func(vs ...string) kafka.Message {
		var m kafka.Message
		for _, v := range vs {
			m.Headers = append(m.Headers, kafka.Header{Key: position.HeaderName, Value: []byte(v)}, kafka.Header{Key: "x", Value: []byte("y")})
		}
		return m
	}
	for name, tc := range map[string]struct {
		msg     kafka.Message
		want    map[string]string // database → LSN
		invalid bool
	}{
		"no header":      {msg: kafka.Message{}},
		"empty header":   {msg: header("")},
		"one":            {msg: header(a), want: map[string]string{"main": "0/1000"}},
		"two, merged":    {msg: header(a, b), want: map[string]string{"main": "0/3000"}},
		"two databases":  {msg: header(b, "", billing), want: map[string]string{"main": "0/3000", "billing": "2/0"}},
		"malformed":      {msg: header("garbage"), invalid: true},
		"one malformed":  {msg: header(a, "garbage", b), invalid: true},
		"newer version":  {msg: header("v9;from-the-future"), invalid: true},
		"other key only": {msg: kafka.Message{Headers: []kafka.Header{{Key: "caughtup-token-x", Value: []byte(a)}}}},
	} {
		tok, err := caughtupkafka.TokenOf(tc.msg)
		if tc.invalid {
			var de *position.DecodeError
			require.ErrorAs(t, err, &de, name)
			require.True(t, tok.IsZero(), "%s: a token that does not decode is no token at all", name)
			continue
		}
		require.NoError(t, err, name)
		require.Len(t, tok.Entries, len(tc.want), name)
		for db, lsn := range tc.want {
			e, ok := tok.Entry(db)
			require.True(t, ok, "%s: %s", name, db)
			require.Equal(t, position.MustParseLSN(lsn), e.LSN, "%s: %s", name, db)
		}
	}
}

func TestConsumerConfigValidation(t *testing.T) {
	t.Parallel()
	e := setupDB(t, nil)
	h := func(context.Context, kafka.Message) error { return nil }
	ok := caughtupkafka.ConsumerConfig{Brokers: []string{"localhost:9092"}, GroupID: "g", Topic: "t", Router: e.Router}
	_, err := caughtupkafka.NewConsumer(ok, h)
	require.NoError(t, err)
	_, err = caughtupkafka.NewConsumer(ok, nil)
	require.ErrorIs(t, err, caughtupkafka.ErrInvalidConfig)

	cfg := ok.WithDefaults()
	require.Equal(t, "t.retry", cfg.RetryTopic)
	require.Equal(t, "t.dlt", cfg.DeadLetterTopic)
	require.Equal(t, caughtupkafka.DefaultMaxAttempts, cfg.MaxAttempts)
	require.Equal(t, kafka.FirstOffset, cfg.StartOffset)

	for name, mutate := range map[string]func(*caughtupkafka.ConsumerConfig){
		"no brokers":    func(c *caughtupkafka.ConsumerConfig) { c.Brokers = nil },
		"no group":      func(c *caughtupkafka.ConsumerConfig) { c.GroupID = "" },
		"no topic":      func(c *caughtupkafka.ConsumerConfig) { c.Topic = "" },
		"no router":     func(c *caughtupkafka.ConsumerConfig) { c.Router = nil },
		"bad policy":    func(c *caughtupkafka.ConsumerConfig) { c.Policy = 42 },
		"bad mode":      func(c *caughtupkafka.ConsumerConfig) { c.Mode = 7 },
		"retry is main": func(c *caughtupkafka.ConsumerConfig) { c.Mode, c.RetryTopic = caughtupkafka.RetryTopic, "t" },
		"dlt is main":   func(c *caughtupkafka.ConsumerConfig) { c.DeadLetterTopic = "t" },
		"attempts":      func(c *caughtupkafka.ConsumerConfig) { c.MaxAttempts = -1 },
		"backoff": func(c *caughtupkafka.ConsumerConfig) {
			c.RetryBackoffInitial, c.RetryBackoffMax = time.Second, time.Millisecond
		},
		"start offset":     func(c *caughtupkafka.ConsumerConfig) { c.StartOffset = 42 },
		"negative commits": func(c *caughtupkafka.ConsumerConfig) { c.CommitInterval = -time.Second },
	} {
		c := ok
		mutate(&c)
		_, err := caughtupkafka.NewConsumer(c, h)
		require.ErrorIs(t, err, caughtupkafka.ErrInvalidConfig, name)
		require.True(t, strings.HasPrefix(err.Error(), "caughtup/kafka: invalid consumer config: "), name)
	}
	_, err = caughtupkafka.NewConsumer(caughtupkafka.ConsumerConfig{Brokers: []string{"localhost:9092"}, GroupID: "g", Topic: "t"}, h)
	require.ErrorContains(t, err, "consume.NewRouter", "the error says what to do")
}

func TestRunTwiceAtOnce(t *testing.T) {
	t.Parallel()
	topic := kafkasuite.NewTopics(t, 1, "")[0]
	ran := make(chan struct{}, 1)
	e := setupDB(t, nil)
	r := startConsumer(t, caughtupkafka.ConsumerConfig{Topic: topic, Router: e.Router}, func(context.Context, kafka.Message) error {
		ran <- struct{}{}
		return nil
	})
	require.NoError(t, newWriter(t, topic).WriteMessages(t.Context(), kafka.Message{Value: []byte("x")}))
	<-ran
	require.ErrorIs(t, r.c.Run(context.Background()), caughtupkafka.ErrRunning)
}

// TestMiddlewareRoutesAndDefers exercises the decorator on its own, as code
// with its own consume loop would use it.
func TestMiddlewareRoutesAndDefers(t *testing.T) {
	t.Parallel()
	e := setupDB(t, func(c *consume.Config) { c.WaitBudget = -1 })
	ctx, err := e.Insert(t.Context(), 1, "k", 0)
	require.NoError(t, err)
	msg := kafka.Message{Value: []byte("x")}
	require.NoError(t, caughtupkafka.Stamp(ctx, &msg))
	require.NoError(t, e.Cluster.WaitReplicasCaughtUp(t.Context()))

	var got consume.Decision
	h := caughtupkafka.Middleware(e.Router, consume.Delayed)(func(ctx context.Context, m kafka.Message) error {
		got, _ = consume.DecisionFrom(ctx)
		require.NotNil(t, consume.DB(ctx, "main"))
		return nil
	})
	require.Eventually(t, func() bool { return h(t.Context(), msg) == nil }, 5*time.Second, 10*time.Millisecond)
	require.Equal(t, consume.OutcomeReplica, got.Outcome)

	far := kafka.Message{Value: []byte("x")}
	require.NoError(t, caughtupkafka.Stamp(enqueue.WithToken(t.Context(), e.FarAhead(t)), &far))
	err = h(t.Context(), far)
	var de *consume.DeferError
	require.ErrorAs(t, err, &de, "a message no replica can serve is returned as a deferral")
	require.Positive(t, de.Delay)

	// Headers that do not decode read the primary, even beside a good one.
	good := msg.Headers[0]
	bad := kafka.Message{Topic: "events", Headers: []kafka.Header{good, {Key: position.HeaderName, Value: []byte("garbage")}}}
	require.NoError(t, h(t.Context(), bad))
	require.Equal(t, consume.OutcomePrimaryNoToken, got.Outcome)
	require.Equal(t, consume.ReasonMalformedToken, got.Reason)
}
