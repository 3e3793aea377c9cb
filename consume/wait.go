package consume

import (
	"context"
	"errors"
	"time"
)

// wait re-decides on every snapshot the tracker publishes until Decide
// stops saying ActionWait or the budget runs out; meanwhile the replicas
// it waits on are polled every WaitPollInterval.
func (r *Router) wait(ctx context.Context, in *DecideInput, d Decision) (Decision, error) {
	start := r.cfg.Now()
	budget := r.cfg.WaitBudget
	if dl, ok := ctx.Deadline(); ok {
		budget = min(budget, time.Until(dl)) // ctx's deadline is on the real clock
	}
	in.Waited = true
	if budget <= 0 {
		in.NoWait = true
		return Decide(*in), nil
	}
	defer r.watch(&d)()
	timer := time.NewTimer(budget)
	defer timer.Stop()
	for {
		snap := r.snapshot()
		in.Snapshot, in.Now = snap, r.cfg.Now()
		d = Decide(*in)
		if d.Action != ActionWait {
			d.Waited = r.cfg.Now().Sub(start)
			return d, nil
		}
		select {
		case <-snap.Changed():
			continue
		case <-timer.C:
		case <-ctx.Done():
			// A deadline only shortened the budget (it and the timer fire
			// together); a cancellation abandons the job.
			if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				d.Waited = r.cfg.Now().Sub(start)
				return d, ctx.Err()
			}
		}
		in.NoWait = true
		in.Snapshot, in.Now = r.snapshot(), r.cfg.Now()
		d = Decide(*in)
		d.Waited = r.cfg.Now().Sub(start)
		return d, nil
	}
}

// watch speeds up polling of the replicas a waiting decision could be
// satisfied by: those of the databases still behind that answered their
// last query (replay.Tracker.Watch). Failing replicas keep the slow pace,
// so a wait never turns into a reconnect storm.
func (r *Router) watch(d *Decision) func() {
	var undo []func()
	for _, dd := range d.Databases {
		if dd.Outcome == outcomeWait {
			undo = append(undo, r.tr.Watch(dd.Database))
		}
	}
	return func() {
		for _, u := range undo {
			u()
		}
	}
}
