package consume

import (
	"context"
	"errors"
	"time"

	"github.com/caughtup/caughtup/replicapool"
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
	probed := start
	for {
		snap := r.snapshot()
		in.Snapshot, in.Now = snap, r.cfg.Now()
		d = Decide(*in)
		if d.Action == ActionWait && in.Now.Sub(probed) >= probeEvery {
			// A server behind a balanced pool that the tracker does not
			// watch may have caught up meanwhile.
			probed = in.Now
			if r.probeBehind(ctx, &d) {
				in.Snapshot = r.snapshotAt(in.Now)
				d = Decide(*in)
			}
		}
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

// probeEvery is how often a waiting job looks again for a server behind a
// balanced pool that has its token (probeBehind): a few times within the
// default wait budget, each look a query on a pool whose probe budget is
// shared by every waiting job.
const probeEvery = 50 * time.Millisecond

// probeBehind looks, for each database d reads from the primary or waits
// on because its replicas are behind, for a server behind one of its
// replica pools that has replayed the token although the server the
// tracker watches there has not: a pool that reaches more than one server
// (a balancer, a pooler) or has not shown yet that it reaches only one
// (replicapool.Pool.Probe). It reports whether one was found; the router's
// snapshot then shows it (replicapool.Pool.Lift), and the job is decided
// again. A pool known to reach one server is never probed: the tracker
// already watches that server.
func (r *Router) probeBehind(ctx context.Context, d *Decision) bool {
	found := false
	for i := range d.Databases {
		dd := &d.Databases[i]
		if dd.replica >= 0 || dd.Reason != ReasonReplicaBehind && dd.Reason != ReasonReplicaRestarted {
			continue
		}
		for _, p := range r.handlers[dd.Database] {
			if p == nil || p.Topology() == replicapool.TopologySingle {
				continue
			}
			pctx, cancel := context.WithTimeout(ctx, r.probeTimeout())
			_, ok := p.Probe(pctx, dd.Entry)
			cancel()
			if ok {
				found = true
				break
			}
		}
	}
	return found
}

// probeTimeout bounds one probe: the wait budget, within the staleness
// bound; 100ms for a router that does not wait.
func (r *Router) probeTimeout() time.Duration {
	if r.cfg.WaitBudget > 0 {
		return min(r.cfg.WaitBudget, r.cfg.Tracker.StalenessBound)
	}
	return 100 * time.Millisecond
}
