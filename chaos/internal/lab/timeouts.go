package lab

import (
	"context"
	"fmt"
	"maps"
	"time"

	"github.com/hibiken/asynq"
	"golang.org/x/time/rate"

	"github.com/caughtup/caughtup/consume"
)

// The fallback cap of the timeout-tasks scenario: a few reads per second.
const (
	timeoutCapRate  = 5
	timeoutCapBurst = 5
)

// timeoutTasksScenario: asynq tasks that carry asynq.Timeout and no
// asynq.Deadline, under a replay pause long enough that their deferrals
// outlast an attempt's Timeout, with a small fallback cap.
//
// asynq gives every attempt of such a task a fresh deadline (now +
// Timeout), so deferring it is safe, and the middleware must: a deferral
// whose delay (plus 2s of slack) outlasts the attempt's deadline is where
// it has to tell a Timeout from a Deadline, and an override there (reading
// the primary now, past the cap if the cap refuses) is what issue 12 found
// sending every Timeout(30s) task to the primary once lag passed about 31s.
// Checks: no override of any kind is counted (caughtup.asynq.overrides),
// primary reads in any 1s window stay within the cap, deferrals past the
// attempt's deadline did happen for both Timeout values (else the edge was
// not reached), and every task completes once replay resumes (0 lost).
// Only asynq: Kafka has no per-attempt deadline.
func timeoutTasksScenario(sl scale) *scenario {
	return &scenario{
		name: "timeout-tasks",
		about: fmt.Sprintf("asynq tasks with asynq.Timeout(%s) or asynq.Timeout(%s) and no Deadline (delayed policy), replay paused on both replicas "+
			"for %s, fallback cap %d/s burst %d: deferrals outlast the attempts' timeouts, and must still be deferrals",
			sl.timeouts[0], sl.timeouts[1], sl.timeoutPause, timeoutCapRate, timeoutCapBurst),
		policy:    consume.Delayed,
		asynqOnly: true,
		router:    func(c *consume.Config) { c.PrimaryRate, c.PrimaryBurst = rate.Limit(timeoutCapRate), timeoutCapBurst },
		taskOptions: func(p payload) []asynq.Option {
			return []asynq.Option{asynq.Timeout(sl.timeouts[p.ID%2])}
		},
		span: func(s scale) time.Duration { return s.span(s.lead + s.timeoutPause + s.tail) },
		fault: func(ctx context.Context, r *run) error {
			return pauseAllFor(ctx, r, r.sl.timeoutPause, ": every task defers, past its attempt's Timeout as the lag grows")
		},
		check: checkTimeouts,
	}
}

func checkTimeouts(r *run, res *scenarioResult) {
	expectDeferrals(r, res)
	checkPrimaryWindow(r, res)
	overrides, total := r.asynqOverrides()
	r.note("caughtup.asynq.overrides: %d %v", total, overrides)
	if total > 0 {
		r.fail("the asynq middleware overrode %d routing decisions %v: a Timeout-only task must defer like any other", total, overrides)
	}
	r.ast.mu.Lock()
	past := maps.Clone(r.ast.pastDeadline)
	r.ast.mu.Unlock()
	r.note("deferrals that outlasted their attempt's deadline, by the attempt's Timeout: %v", past)
	for _, t := range r.sl.timeouts {
		if past[t] == 0 {
			r.fail("no Timeout(%s) task was deferred past its attempt's deadline: the scenario did not reach the edge it tests", t)
		}
	}
}
