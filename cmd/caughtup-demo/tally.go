package main

import "sync"

// tally is one consumer path's checker: what each request wrote, and what
// each of its jobs and events read.
type tally struct {
	name string
	mu   sync.Mutex
	// want is the version each request wrote; a request that never
	// committed is absent, so nothing is expected of it.
	want      map[int64]int64
	skipped   int
	jobs      map[int64]bool
	events    map[int64]bool
	stale     int
	runs      int
	onReplica int
}

func newTally(name string) *tally {
	return &tally{name: name, want: map[int64]int64{}, jobs: map[int64]bool{}, events: map[int64]bool{}}
}

func (t *tally) expect(id, version int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.want[id] = version
}

func (t *tally) expectNone(int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.skipped++
}

func (t *tally) record(id int64, event, stale, onReplica bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if event {
		t.events[id] = true
	} else {
		t.jobs[id] = true
	}
	t.runs++
	if stale {
		t.stale++
	}
	if onReplica {
		t.onReplica++
	}
}

// complete reports whether every committed request out of n has had its
// job and its event handled.
func (t *tally) complete(n int) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.jobs) == len(t.want) && len(t.events) == len(t.want) && len(t.want)+t.skipped >= n
}

func (t *tally) side(requests int) Side {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := Side{Name: t.name, Jobs: len(t.jobs), Events: len(t.events), Stale: t.stale, Runs: t.runs, ReplicaRuns: t.onReplica, PrimaryRun: t.runs - t.onReplica}
	for id := range t.want {
		if !t.jobs[id] {
			s.Lost++
		}
		if !t.events[id] {
			s.Lost++
		}
	}
	return s
}

func (t *tally) counts() (handled, stale int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.jobs) + len(t.events), t.stale
}

func (t *tally) committed() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.want)
}
