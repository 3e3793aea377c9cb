package asynq

import (
	"context"
	"errors"
	"time"

	hasynq "github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
)

// DelayedTaskCheckInterval is what ServerConfig sets
// asynq.Config.DelayedTaskCheckInterval to when it is zero. asynq's own
// default, 5s, would add up to 5s to every deferral (the router's first
// is 1s) and to every retry; a due-task check per second is one cheap
// Redis script per queue.
const DelayedTaskCheckInterval = time.Second

// ServerConfig returns cfg with the hooks a server running Middleware
// needs. Pass the result to asynq.NewServer:
//
//		srv := asynq.NewServer(redisOpt, caughtupasynq.ServerConfig(asynq.Config{Concurrency: 20}))
//
//	  - RetryDelayFunc: a deferral (*consume.DeferError, also wrapped) runs
//	    again after the router's delay, rounded up to the whole second asynq
//	    schedules in. Other errors get cfg.RetryDelayFunc (default
//	    asynq.DefaultRetryDelayFunc), unchanged.
//	  - IsFailure: a deferral is not a failure, so asynq does not count it
//	    against the task's MaxRetry (the router bounds deferral by the
//	    token's age instead). A refusal by the fallback cap
//	    (consume.ErrCapped) is one, so a lasting refusal ends in the
//	    middleware's last-attempt override rather than looping. Other
//	    errors get cfg.IsFailure (default: every error).
//	  - ErrorHandler: cfg's handler is not called for deferrals.
//	  - GroupAggregator: the aggregated task carries the merged token of the
//	    tasks it aggregates (none, so the primary, if any of them has none)
//	    and HeaderDedup if any of them has it.
//	  - DelayedTaskCheckInterval: DelayedTaskCheckInterval when zero.
//
// asynq archives a task that fails on its last attempt whatever IsFailure
// says; Middleware never defers on a last attempt for that reason.
func ServerConfig(cfg hasynq.Config) hasynq.Config {
	delay := cfg.RetryDelayFunc
	if delay == nil {
		delay = hasynq.DefaultRetryDelayFunc
	}
	cfg.RetryDelayFunc = func(n int, err error, task *hasynq.Task) time.Duration {
		var de *consume.DeferError
		if errors.As(err, &de) {
			return retryDelay(de.Delay, time.Now())
		}
		return delay(n, err, task)
	}
	isFailure := cfg.IsFailure
	cfg.IsFailure = func(err error) bool {
		var de *consume.DeferError
		if errors.As(err, &de) {
			return de.Capped()
		}
		if isFailure == nil {
			return err != nil
		}
		return isFailure(err)
	}
	if eh := cfg.ErrorHandler; eh != nil {
		cfg.ErrorHandler = hasynq.ErrorHandlerFunc(func(ctx context.Context, task *hasynq.Task, err error) {
			if !isDeferral(err) {
				eh.HandleError(ctx, task, err)
			}
		})
	}
	if ga := cfg.GroupAggregator; ga != nil {
		cfg.GroupAggregator = aggregator{ga}
	}
	if cfg.DelayedTaskCheckInterval == 0 {
		cfg.DelayedTaskCheckInterval = DelayedTaskCheckInterval
	}
	return cfg
}

// isDeferral reports a deferral for lag (not a refusal by the cap).
func isDeferral(err error) bool {
	var de *consume.DeferError
	return errors.As(err, &de) && !de.Capped()
}

// retryDelay converts the router's delay into the one asynq needs:
// asynq stores the retry time as (now + delay).Unix(), dropping the
// fraction, so the delay is raised to reach the next whole second and the
// task is never due before d has passed.
func retryDelay(d time.Duration, now time.Time) time.Duration {
	at := now.Add(max(d, 0))
	sec := at.Unix()
	if at.Nanosecond() > 0 {
		sec++
	}
	return time.Unix(sec, 0).Sub(now)
}

// aggregator stamps the task a GroupAggregator builds with what the tasks
// of the group need.
type aggregator struct{ next hasynq.GroupAggregator }

var _ hasynq.GroupAggregator = aggregator{}

func (a aggregator) Aggregate(group string, tasks []*hasynq.Task) *hasynq.Task {
	out := a.next.Aggregate(group, tasks)
	if out == nil {
		return nil
	}
	var tok position.Token
	all, dedup := true, false
	for _, t := range tasks {
		h := t.Headers()
		if h[HeaderDedup] != "" {
			dedup = true
		}
		text := h[position.HeaderName]
		if text == "" {
			all = false
			continue
		}
		dt, err := position.Decode(text)
		if err != nil {
			all = false
			continue
		}
		tok = tok.Merge(dt)
	}
	if !all {
		// A task without a token reads the primary; so must the aggregate.
		out = unstamp(out)
		tok = position.Token{}
	}
	stamped, err := stamp(out, tok, dedup)
	if err != nil {
		return unstamp(out)
	}
	return stamped
}
