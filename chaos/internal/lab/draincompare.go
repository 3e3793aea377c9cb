package lab

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/testkit/drain"
)

// burstDrain is how one burst was started: the jobs enqueued during one
// pause of every replica, which all became runnable when replay resumed.
type burstDrain struct {
	Jobs int `json:"jobs"`
	// Span is from the burst's first catch-up to its last handler start;
	// MeanStart the mean of each job's start after that first catch-up.
	Span      float64 `json:"first_catch_up_to_last_start_ms"`
	MeanStart float64 `json:"mean_start_ms"`
}

// largestBurst measures the drain of the burst of js with the most jobs:
// jobs that could not run at once, were seen caught up and were enqueued
// in the same span of paused.
func largestBurst(js []jobCatchUp, paused []pauseSpan) burstDrain {
	var best burstDrain
	for _, sp := range paused {
		var first, last time.Time
		var n int
		for i := range js {
			j := &js[i]
			if j.atOnce || !j.found || !inSpans(j.enqueued, []pauseSpan{sp}) {
				continue
			}
			n++
			if first.IsZero() || j.read.Before(first) {
				first = j.read
			}
			if j.start.After(last) {
				last = j.start
			}
		}
		if n <= best.Jobs {
			continue
		}
		var sum time.Duration
		for i := range js {
			j := &js[i]
			if !j.atOnce && j.found && inSpans(j.enqueued, []pauseSpan{sp}) {
				sum += j.start.Sub(first)
			}
		}
		best = burstDrain{Jobs: n, Span: ms(last.Sub(first)), MeanStart: ms(sum / time.Duration(n))}
	}
	return best
}

// drainComparison sets caughtup's drain of its largest burst beside plain
// asynq draining as many pending tasks on the same machine, in the same
// run (issue #27's drain ratio): what the 2 cores allow any policy, and so
// how far the GitLab-style baseline's mean over caughtup's can go.
type drainComparison struct {
	Caughtup burstDrain `json:"caughtup_asynq"`
	// Bare is plain asynq, with the suite's server config, starting
	// Caughtup.Jobs tasks made pending at once (each sleeps 1ms, about the
	// pipeline's read): Span to the last start, MeanStart the mean start.
	Bare burstDrain `json:"bare_asynq"`
	// Ratio is Bare.Span / Caughtup.Span (≥ 0.9 is the goal).
	Ratio float64 `json:"drain_ratio_bare_over_caughtup"`
	// GitLabMean is the GitLab-style asynq stream's mean catch-up → start
	// on the jobs enqueued while every replica was paused; Ceiling is it
	// over Bare.MeanStart: the GitLab-style mean over caughtup's that a
	// policy starting each burst at plain asynq's pace would reach here.
	GitLabMean float64 `json:"gitlab_asynq_mean_ms"`
	Ceiling    float64 `json:"gitlab_over_bare_mean"`
	// Error is why the bare side could not be measured.
	Error string `json:"error,omitempty"`
}

// bareAsynqDrain starts n tasks, scheduled far ahead and then made pending
// in one call, on a plain asynq server configured as the suite's, and
// measures from just before that call to each start.
func bareAsynqDrain(ctx context.Context, s *services, n int) (burstDrain, error) {
	queue := s.name("bare-drain")
	st := drain.NewStarts(n)
	mux := asynq.NewServeMux()
	mux.HandleFunc(taskType, func(ctx context.Context, t *asynq.Task) error {
		at := time.Now()
		i, err := strconv.Atoi(string(t.Payload()))
		if err != nil {
			return fmt.Errorf("%w: %v", asynq.SkipRetry, err)
		}
		st.Start(i, at)
		time.Sleep(time.Millisecond)
		return nil
	})
	srv := asynq.NewServer(s.redisOpt(), caughtupasynq.ServerConfig(s.asynqServerConfig(queue, asynqConcurrency, 250*time.Millisecond)))
	if err := srv.Start(mux); err != nil {
		return burstDrain{}, err
	}
	defer srv.Shutdown()
	client := asynq.NewClient(s.redisOpt())
	defer client.Close()
	insp := asynq.NewInspector(s.redisOpt())
	defer insp.Close()
	for i := range n {
		if _, err := client.EnqueueContext(ctx, asynq.NewTask(taskType, []byte(strconv.Itoa(i))), asynq.Queue(queue), asynq.ProcessIn(time.Hour)); err != nil {
			return burstDrain{}, err
		}
	}
	t0 := time.Now()
	moved, err := insp.RunAllScheduledTasks(queue)
	if err != nil {
		return burstDrain{}, err
	}
	if moved != n {
		return burstDrain{}, fmt.Errorf("bare drain: %d of %d tasks made pending", moved, n)
	}
	// The starts are timed by the handler; polling only ends the wait.
	for deadline := time.Now().Add(time.Minute); st.Started() < n && time.Now().Before(deadline) && ctx.Err() == nil; {
		time.Sleep(5 * time.Millisecond)
	}
	if st.Started() < n {
		return burstDrain{}, fmt.Errorf("bare drain: %d of %d tasks started within a minute", st.Started(), n)
	}
	var sum time.Duration
	for i := range n {
		sum += st.At(i).Sub(t0)
	}
	return burstDrain{Jobs: n, Span: ms(st.Last().Sub(t0)), MeanStart: ms(sum / time.Duration(n))}, nil
}
