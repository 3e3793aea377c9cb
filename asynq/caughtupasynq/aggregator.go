package caughtupasynq

import (
	"context"
	"log/slog"
	"time"

	"github.com/hibiken/asynq"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/position"
)

// aggregator stamps the task a GroupAggregator builds with what the tasks
// of its group need. asynq enqueues that task with its own options plus
// asynq.Queue, so the task must be stamped in a way that keeps them:
//
//   - a task with a headers map (NewTaskWithHeaders with a non-nil map, or
//     one of the group's own tasks) is stamped in place: the aggregator
//     returns a task asynq enqueues and then drops, so its map is the
//     aggregator's to change. Return a new task per call, as asynq's
//     examples do, not one shared between calls.
//   - a task this package built (NewTask) is rebuilt with its options.
//   - any other task (asynq.NewTask: no map, options unknown) is left as
//     it is: it carries no token and reads the primary; that is logged as
//     an error and counted (caughtup.asynq.aggregates.unstamped).
type aggregator struct {
	next asynq.GroupAggregator
	met  *metrics
	log  *slog.Logger
	warn *rate.Sometimes
}

func newAggregator(next asynq.GroupAggregator, met *metrics, log *slog.Logger) *aggregator {
	return &aggregator{next: next, met: met, log: log, warn: &rate.Sometimes{First: 1, Interval: time.Minute}}
}

var _ asynq.GroupAggregator = (*aggregator)(nil)

func (a *aggregator) Aggregate(group string, tasks []*asynq.Task) *asynq.Task {
	out := a.next.Aggregate(group, tasks)
	if out == nil {
		return nil
	}
	text, dedup, err := groupHeader(tasks)
	if err != nil {
		text = ""
		a.unstamped(out, group, err.Error())
	}
	h := out.Headers()
	var e headerEdit
	if text == "" {
		// A task without a token reads the primary; so must the
		// aggregate, whatever its aggregator wrote.
		if _, ok := h[position.HeaderName]; ok {
			e.setToken = true
		}
	} else {
		// The group's token merged into what the aggregator wrote, by the
		// one rule: a value that does not decode stays as it is.
		merged, err := position.MergeHeaderValues(h[position.HeaderName], text)
		if err != nil {
			merged = ""
			a.unstamped(out, group, err.Error())
		}
		if merged != h[position.HeaderName] {
			e.token, e.setToken = merged, true
		}
	}
	own, known := optionsOf(out)
	switch {
	case dedup || dedupOption(own):
		if h[HeaderDedup] != "1" {
			e.dedup = "1"
		}
	case known && h[HeaderDedup] == "":
		e.dedup = "0"
	}
	switch {
	case known:
		if t := stampedToken(h, e); t != "" {
			if dl := deadlineValue(own); h[HeaderDeadline] != dl {
				e.deadline, e.setDL = dl, true
			}
		}
		if e.empty() {
			return out
		}
		return rebuild(out, own, e, false)
	case h != nil:
		// The options are unknown, so no HeaderDeadline can be vouched
		// for: the middleware looks the deadline up or assumes the worst.
		if _, ok := h[HeaderDeadline]; ok {
			e.deadline, e.setDL = "", true
		}
		e.applyInPlace(h)
		return out
	case e.setToken && e.token != "":
		a.unstamped(out, group, "")
	}
	return out
}

// stampedToken is the token header h has once e is applied.
func stampedToken(h map[string]string, e headerEdit) string {
	if e.setToken {
		return e.token
	}
	return h[position.HeaderName]
}

// groupHeader returns the token header the aggregate of tasks needs: the
// merge of theirs (position.MergeHeaderValues: the first value that does
// not decode stands for all, so the aggregate reads the primary, counted
// as malformed), or "" if a task has no token; and whether any task may
// stand for deduplicated enqueues (mayBeDeduplicated).
func groupHeader(tasks []*asynq.Task) (text string, dedup bool, err error) {
	values := make([]string, 0, len(tasks))
	missing := false
	for _, t := range tasks {
		h := t.Headers()
		if mayBeDeduplicated(h) {
			dedup = true
		}
		v := h[position.HeaderName]
		if v == "" {
			missing = true
			continue
		}
		values = append(values, v)
	}
	if missing {
		return "", dedup, nil
	}
	text, err = position.MergeHeaderValues(values...)
	return text, dedup, err
}

func (a *aggregator) unstamped(out *asynq.Task, group, why string) {
	ctx := context.Background()
	a.met.unstampedAggregate(ctx)
	if !a.log.Enabled(ctx, slog.LevelError) {
		return
	}
	a.warn.Do(func() {
		msg := "caughtup: the task a GroupAggregator returned cannot carry its group's token and reads the primary; build it with caughtupasynq.NewTask(ctx, ...) or asynq.NewTaskWithHeaders with a non-nil headers map"
		attrs := []slog.Attr{
			slog.String("messaging.system", "asynq"),
			slog.String("caughtup.asynq.task_type", out.Type()),
			slog.String("caughtup.asynq.group", group),
		}
		if why != "" {
			msg = "caughtup: the token of an aggregated task's group cannot be carried; the task reads the primary"
			attrs = append(attrs, slog.String("error", why))
		}
		a.log.LogAttrs(ctx, slog.LevelError, msg, attrs...)
	})
}
