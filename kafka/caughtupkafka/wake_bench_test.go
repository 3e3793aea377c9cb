package caughtupkafka_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/kafka/caughtupkafka"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/catchup"
	"github.com/caughtup/caughtup/testkit/kafkasuite"
	"github.com/caughtup/caughtup/testkit/latency"
)

// BenchmarkRetryTopicWakeLatency measures how soon messages deferred to
// the retry topic run once replay resumes. Replay is paused on every
// replica, 200 messages (4 partitions, 4 retry partitions), each reading
// a row written just before, are produced over the first 2s, so that each
// goes to the retry topic (due 1s later, then 2s, …); replay resumes at
// 3s. It prints p50/p99/max of
//
//   - resume → handler start;
//   - catch-up → handler start: from the moment the tracker had read the
//     observation that first showed a replica past the message's token
//     (catchup.FirstCaughtUp over the snapshots a follower recorded,
//     CatchUp.Read) to the handler's start;
//   - resume → due: when the message's due time would have let it run
//     without the wake (0 if already due).
//
// Messages that were waiting in Route on the main topic when replay
// resumed are reported apart. Router and consumer defaults but for a
// WaitBudget of 5ms, so that the main topic's partitions, which wait for
// one message at a time, defer every message within the pause. It
// asserts nothing about time. Run it alone:
//
//	go test -run '^$' -bench RetryTopicWakeLatency -benchtime 1x ./kafka/
func BenchmarkRetryTopicWakeLatency(b *testing.B) {
	// A partition waits for each of its messages in turn: with the
	// default 500ms budget four partitions would defer only 24 messages
	// in 3s.
	e := setupDB(b, func(c *consume.Config) { c.WaitBudget = 5 * time.Millisecond })
	var r retryLatencies
	var woken int64
	for b.Loop() {
		w0 := e.Results(b)["woken"]
		r = retryRound(b, e)
		woken = e.Results(b)["woken"] - w0
	}
	p := func(s []time.Duration, q float64) time.Duration {
		return latency.Percentile(s, q).Round(100 * time.Microsecond)
	}
	var tb strings.Builder
	fmt.Fprintf(&tb, "\n| kafka RetryTopic, 200 messages through a 3 s pause | from the retry topic | resume → start p50 | p99 | max | catch-up → start p50 | p99 | max | resume → due p50 | p99 | woken | waiting on the main topic at resume | resume → start p50 | max |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	fmt.Fprintf(&tb, "| wake | %d | %v | %v | %v | %v | %v | %v | %v | %v | %d | %d | %v | %v |\n", len(r.resume),
		p(r.resume, 0.5), p(r.resume, 0.99), p(r.resume, 1), p(r.catch, 0.5), p(r.catch, 0.99), p(r.catch, 1),
		p(r.due, 0.5), p(r.due, 0.99), woken, len(r.main), p(r.main, 0.5), p(r.main, 1))
	b.Log(tb.String())
	b.ReportMetric(float64(p(r.catch, 0.99))/1e6, "catchup-start-p99-ms")
	b.ReportMetric(float64(p(r.resume, 0.99))/1e6, "resume-start-p99-ms")
}

type retryLatencies struct{ resume, catch, due, main []time.Duration }

func retryRound(b *testing.B, e *env) retryLatencies {
	const messages = 200
	ctx := context.Background()
	names := kafkasuite.NewTopics(b, 4, "", ".retry", ".dlt")
	type run struct {
		at    time.Time
		due   time.Time
		retry bool
	}
	var (
		mu     sync.Mutex
		runs   = map[int64]run{}
		all    = make(chan struct{})
		warmed = make(chan struct{}, 1)
		warmID = stampedIDs.Add(1)
	)
	c := startConsumer(b, caughtupkafka.ConsumerConfig{
		Topic: names[0], Mode: caughtupkafka.RetryTopic, Router: e.Router, Policy: consume.Delayed, MeterProvider: e.MP,
	}, func(ctx context.Context, msg kafka.Message) error {
		rn := run{at: time.Now(), retry: msg.Topic == names[1]}
		if ms, err := strconv.ParseInt(header(msg, caughtupkafka.HeaderDue), 10, 64); err == nil {
			rn.due = time.UnixMilli(ms)
		}
		id, err := strconv.ParseInt(string(msg.Value), 10, 64)
		if err != nil {
			return err
		}
		var n int
		if err := consume.DB(ctx, "main").QueryRow(ctx, `SELECT count(*) FROM items WHERE id = $1`, id).Scan(&n); err != nil {
			return err
		}
		if id == warmID {
			warmed <- struct{}{}
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		if _, ok := runs[id]; !ok {
			runs[id] = rn
			if len(runs) == messages {
				close(all)
			}
		}
		return nil
	})
	defer func() { require.NoError(b, c.Stop()) }()
	w := caughtupkafka.NewWriter(newWriter(b, names[0]))
	// The group owns the partitions before the clock starts.
	wctx, err := e.Insert(ctx, warmID, "warm", 0)
	require.NoError(b, err)
	require.NoError(b, w.WriteMessages(wctx, kafka.Message{Key: []byte("warm"), Value: []byte(strconv.FormatInt(warmID, 10))}))
	wait(b, warmed, "the warm-up message")

	stopFollow := latency.Follow(e.Router.Snapshot)
	for _, n := range e.Cluster.Replicas() {
		require.NoError(b, n.PauseReplay(ctx))
	}
	paused := time.Now()
	base := stampedIDs.Add(messages) - messages
	toks := map[int64]position.Token{}
	for i := range int64(messages) {
		id := base + i + 1
		pctx, err := e.Insert(ctx, id, "k"+strconv.FormatInt(i%16, 10), int(i))
		require.NoError(b, err)
		toks[id], _ = enqueue.TokenFrom(pctx)
		require.NoError(b, w.WriteMessages(pctx, kafka.Message{Key: []byte(strconv.FormatInt(i%16, 10)), Value: []byte(strconv.FormatInt(id, 10))}))
		time.Sleep(time.Until(paused.Add(time.Duration(i+1) * 2 * time.Second / messages)))
	}
	time.Sleep(time.Until(paused.Add(3 * time.Second)))
	resumed := time.Now()
	for _, n := range e.Cluster.Replicas() {
		require.NoError(b, n.ResumeReplay(ctx))
	}
	select {
	case <-all:
	case <-time.After(2 * time.Minute):
		b.Fatalf("not every message ran within 2 minutes of the resume")
	}
	recorded := stopFollow()
	cfg := e.Router.Config()
	var out retryLatencies
	mu.Lock()
	defer mu.Unlock()
	for id, rn := range runs {
		if !rn.retry {
			out.main = append(out.main, rn.at.Sub(resumed))
			continue
		}
		out.resume = append(out.resume, rn.at.Sub(resumed))
		out.due = append(out.due, max(rn.due.Sub(resumed), 0))
		if caught, ok := catchup.FirstCaughtUp(toks[id], recorded, &cfg); ok {
			out.catch = append(out.catch, rn.at.Sub(caught.Read))
		} else {
			b.Errorf("message %d: the recorded snapshots never show its token caught up", id)
		}
	}
	return out
}
