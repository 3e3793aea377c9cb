package replicapool

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caughtup/caughtup/internal/retry"
)

// What this process's handlers find, the tracker may not: a replica the
// feed (or the tracker's own connection) calls healthy can be out of reach
// of the handlers' pool (a firewall, a proxy that resets new connections,
// a password rotated on one side), or its connections can keep reaching a
// server behind the job (a balancer whose choice moved). A failure to
// connect, or BehindRun jobs in a row that met only lagging servers, leave
// the replica out of the router's decisions: its jobs go to another
// replica, wait, are deferred or read the primary under the cap, instead
// of failing against it attempt after attempt.
//
// Failures make exclusions that grow: ExclusionBase for the first,
// doubling for each later one (or failed re-probe) within forgetAfter of
// the one before, at most MaxExclusion. Failures during an exclusion (jobs
// routed before it began) are part of it. When an
// exclusion for unreachability runs out, the replica stays out until a
// re-probe (one connection, one trivial query) succeeds; a failed re-probe
// extends it. An exclusion for lag (connections reached only servers
// behind the job) runs out by itself, since lag is the job's to judge.

// ErrUnreachable is the Err a router's snapshot shows for a replica its
// handlers could not connect to; it wraps the connection error.
var ErrUnreachable = errors.New("caughtup/replicapool: this process's handlers cannot reach the replica")

// Bounds of an exclusion.
const (
	// ExclusionBase is the first exclusion of a run of failures: long
	// enough that the jobs retried next go elsewhere, short enough that a
	// replica back in reach after a blip is used again within a second.
	ExclusionBase = time.Second
	// MaxExclusion bounds an exclusion however many failures came before:
	// a replica that recovers is used again within half a minute.
	MaxExclusion = 30 * time.Second
	// forgetAfter: failures further apart than this start the count
	// again.
	forgetAfter = 2 * MaxExclusion
)

// Reason says why a replica is left out.
type Reason uint8

const (
	// ReasonUnreachable: its connections could not be made or broke.
	ReasonUnreachable Reason = iota + 1
	// ReasonBehind: its connections kept reaching servers behind the job.
	ReasonBehind
)

// String is the reason's name in metrics and logs ("unreachable",
// "behind").
func (r Reason) String() string {
	if r == ReasonBehind {
		return "behind"
	}
	return "unreachable"
}

// health is one replica's exclusion as this process sees it.
type health struct {
	mu       sync.Mutex
	failures int       // in a row: none more than forgetAfter apart
	last     time.Time // the latest failure
	until    time.Time // the exclusion runs out; zero when not excluded
	reason   Reason
	err      error
	probing  bool // a re-probe is running
}

// BehindRun is how many jobs in a row must meet only servers behind them
// before the replica is left out for lag: one such job says little of a
// balanced or pooled endpoint that has a caught-up server behind it (its
// connections reached the lagging ones by chance, and the job is routed
// again), several in a row with none served between them say its choice
// moved to servers that lag.
const BehindRun = 3

// behindRun counts the jobs in a row that met only servers behind them.
type behindRun struct{ n atomic.Int32 }

// failed counts a job that met only servers behind it and reports whether
// that makes BehindRun in a row.
func (b *behindRun) failed() bool { return b.n.Add(1) >= BehindRun }

// reset starts the count again: a job found a caught-up server. Only a
// changed count is written, so that routed acquires share the line
// read-only.
func (b *behindRun) reset() {
	if b.n.Load() != 0 {
		b.n.Store(0)
	}
}

// transition is what a change of health means for logs and metrics.
type transition uint8

const (
	noTransition transition = iota
	excludedNow             // the replica left the router's decisions
	readmitted              // it is back
)

// fail records a failure at now; it reports whether that started an
// exclusion (a transition), and the exclusion's end.
func (h *health) fail(now time.Time, reason Reason, err error) (transition, time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.until.IsZero() {
		// The same exclusion: jobs routed before it started fail too. It
		// grows when a re-probe fails, or at the next exclusion.
		if h.reason != ReasonUnreachable || reason == ReasonUnreachable {
			h.reason, h.err = reason, err
		}
		h.last = now
		return noTransition, h.until
	}
	if now.Sub(h.last) > forgetAfter {
		h.failures = 0
	}
	h.failures++
	h.last = now
	h.until = now.Add(retry.Nth(h.failures, ExclusionBase, MaxExclusion))
	tr := excludedNow
	// Unreachable wins over behind: it is the one that needs a re-probe.
	if h.reason != ReasonUnreachable || reason == ReasonUnreachable {
		h.reason, h.err = reason, err
	}
	return tr, h.until
}

// state reports whether the replica is excluded at now, why, and whether
// the caller must start a re-probe (the exclusion for unreachability ran
// out and no re-probe runs): the replica then stays excluded until
// succeeded. An exclusion for lag that ran out ends (a transition).
func (h *health) state(now time.Time) (excluded bool, err error, reprobe bool, tr transition) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.until.IsZero():
		return false, nil, false, noTransition
	case now.Before(h.until):
		return true, h.err, false, noTransition
	case h.reason == ReasonBehind:
		h.until, h.err, h.reason = time.Time{}, nil, 0
		// failures stay: a lag exclusion that keeps recurring grows.
		return false, nil, false, readmitted
	}
	if !h.probing {
		h.probing = true
		return true, h.err, true, noTransition
	}
	return true, h.err, false, noTransition
}

// succeeded records a successful re-probe (or connection): an exclusion
// for unreachability ends; one for lag runs its course. The count of failures stays, so that a replica that fails again
// soon after is left out for longer; it is forgotten after forgetAfter
// without a failure.
func (h *health) succeeded() transition {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.probing = false
	if h.until.IsZero() || h.reason == ReasonBehind {
		return noTransition
	}
	h.until, h.err, h.reason = time.Time{}, nil, 0
	return readmitted
}

// reprobeFailed ends a re-probe that could not connect: the exclusion
// grows.
func (h *health) reprobeFailed(now time.Time, err error) time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.probing = false
	h.failures++
	h.last = now
	h.until = now.Add(retry.Nth(h.failures, ExclusionBase, MaxExclusion))
	h.reason, h.err = ReasonUnreachable, err
	return h.until
}

// excludedUntil is when the current exclusion runs out (zero when none),
// for a router's cache of what it derived from the pools.
func (h *health) excludedUntil() time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.until
}
