package consume

import (
	"context"
	"time"
)

// Bounds of how often a held job asks the fallback cap again: the local
// cap's interval between tokens, within these.
const (
	minHoldRetry = 10 * time.Millisecond
	maxHoldRetry = time.Second
)

// hold keeps a job that the cap refused, and that may be neither deferred
// nor refused (Job.Hold), until a replica serves it or the cap admits its
// promotion. It decides again on every snapshot the tracker publishes,
// still capped (a replica that caught up serves the job at once), and asks
// the cap only on a timer, every 1/PrimaryRate within 10ms and 1s: the
// fleet budget is a Redis round trip, and snapshots come every few
// milliseconds while replicas are watched. It returns ctx's error if ctx
// ends first. The replicas of the token's databases are watched meanwhile,
// as for a waiting job.
func (r *Router) hold(ctx context.Context, in *DecideInput, d Decision) (Decision, error) {
	start := r.cfg.Now()
	waitedBefore := d.Waited
	var undo []func()
	for _, e := range in.Token.Entries {
		undo = append(undo, r.tr.Watch(e.Database))
	}
	defer func() {
		for _, u := range undo {
			u()
		}
	}()
	retry := maxHoldRetry
	if lim := float64(r.cfg.PrimaryRate); lim > 0 {
		retry = min(maxHoldRetry, max(minHoldRetry, time.Duration(float64(time.Second)/lim)))
	}
	timer := time.NewTimer(retry)
	defer timer.Stop()
	in.Waited, in.NoWait = true, true
	for {
		snap := r.snapshot()
		askCap := false
		select {
		case <-snap.Changed():
		case <-timer.C:
			timer.Reset(retry)
			askCap = true
		case <-ctx.Done():
			d.Waited = waitedBefore + r.cfg.Now().Sub(start)
			return d, ctx.Err()
		}
		in.Snapshot, in.Now, in.Capped = r.snapshot(), r.cfg.Now(), !askCap
		decide(in, &d)
		r.chargeFallback(ctx, in, &d)
		if d.Action != ActionRefuse {
			d.Held = true
			d.Waited = waitedBefore + r.cfg.Now().Sub(start)
			return d, nil
		}
	}
}
