package pgtest

import (
	"context"
	"math/rand/v2"
	"time"
)

// PauseRandomly injects lag until ctx ends: it pauses replay on one
// replica, or on all of them one time in three, for a random spell of up to
// maxPause, resumes, rests up to maxGap, and repeats. Every replica is
// resumed when it returns. Errors go to logf (nil discards them) and do not
// stop it: a test that also stops replicas should not end the fault
// injection with them.
func (c *Cluster) PauseRandomly(ctx context.Context, maxPause, maxGap time.Duration, logf func(format string, args ...any)) {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	// Pause and resume must complete even as ctx ends, or a replica stays
	// paused for the next test.
	bg := context.Background()
	for ctx.Err() == nil {
		replicas := c.Replicas()
		if len(replicas) == 0 {
			return
		}
		paused := replicas
		if rand.IntN(3) > 0 {
			i := rand.IntN(len(replicas))
			paused = replicas[i : i+1]
		}
		for _, n := range paused {
			if err := n.PauseReplay(bg); err != nil {
				logf("pgtest: pause %s: %v", n.Name(), err)
			}
		}
		sleepOrDone(ctx, rand.N(maxPause+1))
		for _, n := range paused {
			if err := n.ResumeReplay(bg); err != nil {
				logf("pgtest: resume %s: %v", n.Name(), err)
			}
		}
		sleepOrDone(ctx, rand.N(maxGap+1))
	}
}

func sleepOrDone(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
