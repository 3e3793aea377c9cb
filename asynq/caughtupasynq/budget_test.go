package caughtupasynq_test

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/feed"
)

// TestCapAndBudgetHoldOnLastAttempts: with every replica paused, a cap of
// one promotion per second (burst 1) and a fleet budget of one per second
// (burst 1), 200 Sticky tasks on their only attempt (MaxRetry 0) never
// read the primary faster than cap + burst in any second, and none is
// lost: those the cap refuses are held in their workers and run once the
// replicas resume. asynq would archive any of them that returned an error.
func TestCapAndBudgetHoldOnLastAttempts(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: setupRedis(t).opt.Addr})
	t.Cleanup(func() { _ = rdb.Close() })
	budget, err := feed.NewBudget(feed.BudgetConfig{Client: rdb, Rate: 1, Burst: 1, Prefix: fmt.Sprintf("caughtup.budget.test.%d.", time.Now().UnixNano())})
	require.NoError(t, err)
	e := setup(t, func(c *consume.Config) {
		c.PrimaryRate, c.PrimaryBurst = 1, 1
		c.FleetBudget = budget
	})
	var mu sync.Mutex
	var primaryAt []time.Time
	rec := newRecorder()
	e.server(t, asynq.Config{Concurrency: 20}, caughtupasynq.MiddlewareConfig{DefaultPolicy: consume.Sticky},
		asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			if d, _ := consume.DecisionFrom(ctx); d.Outcome == consume.OutcomePrimary {
				mu.Lock()
				primaryAt = append(primaryAt, time.Now())
				mu.Unlock()
			}
			v, err := read(ctx, mustAtoi(t, string(task.Payload())))
			rec.add(ctx, run{val: v, err: err})
			return err
		}))
	resume := e.pauseAll(t)
	defer resume()

	const n = 200
	ids := map[string]int64{}
	for i := range int64(n) {
		ctx := e.write(t, ctxT(t), i+1)
		info, err := e.client.EnqueueContext(ctx, caughtupasynq.NewTask(ctx, "once", []byte(strconv.FormatInt(i+1, 10)),
			asynq.MaxRetry(0), asynq.Queue(e.queue)))
		require.NoError(t, err)
		ids[info.ID] = i + 1
	}
	time.Sleep(5 * time.Second)
	resume()
	for range n {
		rec.next(t, time.Minute)
	}
	for id, row := range ids {
		runs := rec.get(id)
		require.Len(t, runs, 1, "task %s", id)
		require.NoError(t, runs[0].err)
		require.Equal(t, value(row), runs[0].val)
	}
	archived, err := e.inspector.ListArchivedTasks(e.queue)
	require.NoError(t, err)
	require.Empty(t, archived, "a task was archived")

	mu.Lock()
	defer mu.Unlock()
	sort.Slice(primaryAt, func(i, j int) bool { return primaryAt[i].Before(primaryAt[j]) })
	most := 0
	for i := range primaryAt {
		j := i
		for j < len(primaryAt) && primaryAt[j].Sub(primaryAt[i]) < time.Second {
			j++
		}
		most = max(most, j-i)
	}
	t.Logf("%d of %d tasks read the primary (most in any 1s window: %d); the rest ran on replicas after the resume", len(primaryAt), n, most)
	require.LessOrEqual(t, most, 2, "primary reads in one second exceed cap + burst")
	require.Positive(t, e.sum(t, "caughtup.asynq.overrides", map[string]string{"caughtup.asynq.override": "last_attempt"}))
}
