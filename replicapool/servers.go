package replicapool

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/caughtup/caughtup/internal/pgwal"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
)

// A server fact is what a pool knows of one server run behind it: the
// highest position it was seen to have replayed, and when a connection
// last reached it.
type serverFact struct {
	run      replay.RunID
	replayed position.Replayed
	// firstSeen and seenAt are when the pool first and last heard of the
	// run.
	firstSeen, seenAt time.Time
}

// Topology is what a pool's connections have shown of the servers behind
// it so far.
type Topology uint8

const (
	// TopologyUnknown: too few connections identified to tell.
	TopologyUnknown Topology = iota
	// TopologySingle: every connection identified reached one server run.
	TopologySingle
	// TopologyBalanced: direct connections reached several server runs
	// lately (a balancer, a multi-host DSN, a DNS name over several
	// standbys, or one server that restarted).
	TopologyBalanced
	// TopologyPooled: connections go through a pooler, or one connection
	// reached several server processes: every routed acquire is checked
	// in its own transaction.
	TopologyPooled
)

// String names the topology ("unknown", "single", "balanced", "pooled").
func (t Topology) String() string {
	switch t {
	case TopologySingle:
		return "single"
	case TopologyBalanced:
		return "balanced"
	case TopologyPooled:
		return "pooled"
	}
	return "unknown"
}

// Cost says what routing reads through a pool of topology t costs, in the
// words the router's logs, caughtup doctor and docs/deployments.md share.
func (t Topology) Cost() string {
	switch t {
	case TopologySingle:
		return "one server: supported, a routed read costs no check query"
	case TopologyBalanced:
		return "several servers behind one endpoint: supported, a routed read on a connection to a server not yet seen to have replayed the job's token costs one check query"
	case TopologyPooled:
		return "a pooler between the pool and its servers: supported, every routed read is checked in the transaction it runs in (two round trips per job)"
	}
	return "not known yet: each connection is checked as it is first used"
}

// TopologyOf is the topology of a pool whose connections reached servers
// distinct server runs, pooled when any connection went through a pooler
// (its server process, pg_backend_pid(), was not the one the protocol's
// key data named): the rule a Pool applies to its own connections and
// caughtup doctor to its sample.
func TopologyOf(servers int, pooled bool) Topology {
	switch {
	case pooled:
		return TopologyPooled
	case servers > 1:
		return TopologyBalanced
	case servers == 1:
		return TopologySingle
	}
	return TopologyUnknown
}

// Parameters of the server table.
const (
	// SeenWindow is how long a server run counts as reachable behind the
	// pool after a connection last reached it: long enough to span a lull
	// in traffic, short enough that a server taken out of a balancer
	// stops counting within a minute.
	SeenWindow = time.Minute
	// maxServers bounds the table; the run seen longest ago goes first.
	maxServers = 16
	// discoverConns is how many connections must have been identified,
	// all on one run, before a pool counts as one server.
	discoverConns = 4
)

// servers is a pool's server table. gen increases whenever a fact that a
// Lift can see changes, so that a router can cache what it derived from
// the table.
type servers struct {
	mu         sync.Mutex
	facts      []serverFact
	identified int // connections identified since the start
	pooled     atomic.Bool
	gen        *atomic.Uint64
}

// learn records that run had replayed r by at (r may be zero: the run
// was reached, its position not placed); a zero run (the server did not
// say) teaches nothing.
func (s *servers) learn(run replay.RunID, r position.Replayed, at time.Time) {
	s.learnFrom(run, r, at, true)
}

// learnFrom is learn; with bump false the change is not announced (Gen):
// a fact about the server the tracker watches changes no Lift.
func (s *servers) learnFrom(run replay.RunID, r position.Replayed, at time.Time, bump bool) {
	if run.IsZero() {
		return
	}
	if r.LSN == 0 || r.Epoch.IsZero() {
		r = position.Replayed{}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.facts {
		f := &s.facts[i]
		if f.run != run {
			continue
		}
		f.seenAt = maxTime(f.seenAt, at)
		if later(r, f.replayed) {
			f.replayed = r
			if bump {
				s.gen.Add(1)
			}
		}
		return
	}
	if len(s.facts) == maxServers {
		oldest := 0
		for i := range s.facts {
			if s.facts[i].seenAt.Before(s.facts[oldest].seenAt) {
				oldest = i
			}
		}
		s.facts = append(s.facts[:oldest], s.facts[oldest+1:]...)
	}
	s.facts = append(s.facts, serverFact{run: run, replayed: r, firstSeen: at, seenAt: at})
	if bump {
		s.gen.Add(1)
	}
}

// firstSeen is when the pool first heard of run; zero if never.
func (s *servers) firstSeen(run replay.RunID) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.facts {
		if s.facts[i].run == run {
			return s.facts[i].firstSeen
		}
	}
	return time.Time{}
}

// identifiedConn counts one connection identified.
func (s *servers) identifiedConn() {
	s.mu.Lock()
	s.identified++
	s.mu.Unlock()
}

// touch records that a connection reached run at at.
func (s *servers) touch(run replay.RunID, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.facts {
		if s.facts[i].run == run {
			s.facts[i].seenAt = maxTime(s.facts[i].seenAt, at)
			return
		}
	}
}

// knows reports whether run is known to have replayed need (caughtUp): a
// connection to it needs no query.
func (s *servers) knows(run replay.RunID, need position.Entry, caughtUp func(position.Entry, position.Replayed) bool) bool {
	if run.IsZero() {
		return false
	}
	r, ok := s.replayed(run)
	return ok && caughtUp(need, r)
}

// replayed is the highest position run is known to have replayed.
func (s *servers) replayed(run replay.RunID) (position.Replayed, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.facts {
		if s.facts[i].run == run {
			return s.facts[i].replayed, true
		}
	}
	return position.Replayed{}, false
}

// better reports whether some run other than run, seen since cutoff, has
// replayed past r: there is a better server behind the pool than the one
// a connection reached.
func (s *servers) better(run replay.RunID, r position.Replayed, cutoff time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.facts {
		if f := &s.facts[i]; f.run != run && !f.seenAt.Before(cutoff) && later(f.replayed, r) {
			return true
		}
	}
	return false
}

// topology is what the table shows at now.
func (s *servers) topology(now time.Time) Topology {
	if s.pooled.Load() {
		return TopologyPooled
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	cutoff := now.Add(-SeenWindow)
	runs := 0
	for i := range s.facts {
		if !s.facts[i].seenAt.Before(cutoff) {
			runs++
		}
	}
	if runs == 1 && s.identified < discoverConns {
		return TopologyUnknown // too few connections to tell one server from a balancer
	}
	return TopologyOf(runs, false)
}

// best is the fact of the run other than except that has replayed the
// most, among those seen since cutoff, and whether there is one.
func (s *servers) best(except replay.RunID, cutoff time.Time) (serverFact, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out serverFact
	found := false
	for i := range s.facts {
		f := s.facts[i]
		if f.run == except || f.seenAt.Before(cutoff) {
			continue
		}
		if !found || later(f.replayed, out.replayed) {
			out, found = f, true
		}
	}
	return out, found
}

// later reports whether a is past b: further on the same timeline, or on
// a newer timeline of the same system (replay follows timelines forward).
// Positions of different systems are never later than each other.
func later(a, b position.Replayed) bool {
	if b.Epoch.IsZero() {
		return !a.Epoch.IsZero()
	}
	if a.Epoch.SystemID != b.Epoch.SystemID {
		return false
	}
	if a.Epoch.Timeline != b.Epoch.Timeline {
		return a.Epoch.Timeline > b.Epoch.Timeline
	}
	return a.LSN > b.LSN
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// runOf is the server run a replica read names.
func runOf(rd pgwal.Replica) replay.RunID {
	return replay.Incarnation{PostmasterStart: rd.PostmasterStart, RecoveryStart: rd.RecoveryStart}.ID()
}

// replayedOf is a replica read's position with its epoch, or zero when
// the read does not place it (not in recovery, timeline or system
// unknown).
func replayedOf(rd pgwal.Replica, system uint64) position.Replayed {
	if !rd.InRecovery || rd.Timeline == 0 || system == 0 || rd.LSN == 0 {
		return position.Replayed{}
	}
	return position.Replayed{Epoch: position.Epoch{SystemID: system, Timeline: rd.Timeline}, LSN: rd.LSN}
}
