package lab

import (
	"container/heap"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/catchup"
	"github.com/caughtup/caughtup/testkit/latency"
)

// The catch-up → start measurement: for every job that could not run at
// once, from the moment the router's tracker had read an observation
// showing a replica past the job's token (firstCaughtUp's
// CatchUp.Read) to the start of the handler run that completed the job.
// The handler's start is read.at: after routing, waits, deferrals and
// retries, right before its query.

// snapFollower records every snapshot a router publishes, oldest first,
// with when it saw each, so that a job's catch-up can be found afterwards
// (firstCaughtUp over the recorded snapshots).
type snapFollower struct {
	quit chan struct{}
	done chan struct{}
	once sync.Once

	// Written by the follower goroutine; read after stop.
	snaps []*replay.Snapshot
	seen  []time.Time
	// skipped counts snapshots published while the follower was busy
	// (gaps in Seq): a job caught up in one of them is seen caught up in
	// the next recorded one, from that one's observation, which makes its
	// latency look that much shorter (see firstCaughtUp).
	skipped uint64
}

func followSnapshots(r *consume.Router) *snapFollower {
	f := &snapFollower{quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(f.done)
		for {
			s := r.Snapshot()
			if n := len(f.snaps); n == 0 || s.Seq != f.snaps[n-1].Seq {
				if n > 0 && s.Seq > f.snaps[n-1].Seq+1 {
					f.skipped += s.Seq - f.snaps[n-1].Seq - 1
				}
				f.snaps = append(f.snaps, s)
				f.seen = append(f.seen, time.Now())
			}
			select {
			case <-s.Changed():
			case <-f.quit:
				return
			}
		}
	}()
	return f
}

// stop ends the recording; the recorded snapshots are then f.snaps.
func (f *snapFollower) stop() {
	f.once.Do(func() { close(f.quit) })
	<-f.done
}

// at returns the index of the last snapshot the follower had seen at t
// (-1 if none).
func (f *snapFollower) at(t time.Time) int {
	return sort.Search(len(f.seen), func(i int) bool { return f.seen[i].After(t) }) - 1
}

// waiting is a token to find the first catch-up of: in the first recorded
// snapshot whose Seq is above after.
type waiting struct {
	tok   position.Token
	after uint64
	// found, seq and read are the result: whether a recorded snapshot
	// shows tok caught up, the first such snapshot's Seq, and that
	// catch-up's CatchUp.Read.
	found bool
	seq   uint64
	read  time.Time
}

// firstCatchUps sets, for each of ws, the first snapshot of snaps (oldest
// first) after ws[i].after in which ws[i].tok is caught up, and its
// CatchUp.Read. It is firstCaughtUp over snaps[after:], for many
// tokens at once: a one-database token is caught up in a snapshot only if
// every lower position of the same epoch is (the rule the asynq wake set
// relies on too), so per (database, epoch) only the lowest waiting token
// needs checking until it is caught up. Cost: the snapshots times the
// groups, plus the tokens times their heap operations.
func firstCatchUps(ws []waiting, snaps []*replay.Snapshot, cfg *consume.Config) {
	order := make([]int, len(ws))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		switch {
		case ws[a].after < ws[b].after:
			return -1
		case ws[a].after > ws[b].after:
			return 1
		}
		return 0
	})
	type gkey struct {
		db    string
		epoch position.Epoch
	}
	groups := map[gkey]*lsnHeap{}
	var multi []int
	one := make([]*replay.Snapshot, 1)
	check := func(i int, s *replay.Snapshot) bool {
		one[0] = s
		c, ok := catchup.FirstCaughtUp(ws[i].tok, one, cfg)
		if ok {
			ws[i].found, ws[i].seq, ws[i].read = true, s.Seq, c.Read
		}
		return ok
	}
	next := 0
	for _, s := range snaps {
		for ; next < len(order) && ws[order[next]].after < s.Seq; next++ {
			i := order[next]
			tok := ws[i].tok
			if len(tok.Entries) != 1 {
				multi = append(multi, i)
				continue
			}
			k := gkey{tok.Entries[0].Database, tok.Entries[0].Epoch}
			h := groups[k]
			if h == nil {
				h = &lsnHeap{ws: ws}
				groups[k] = h
			}
			heap.Push(h, i)
		}
		for k, h := range groups {
			for h.Len() > 0 && check(h.idx[0], s) {
				heap.Pop(h)
			}
			if h.Len() == 0 {
				delete(groups, k)
			}
		}
		multi = slices.DeleteFunc(multi, func(i int) bool { return check(i, s) })
	}
}

// lsnHeap orders indexes of ws by their token's (only) LSN.
type lsnHeap struct {
	ws  []waiting
	idx []int
}

func (h *lsnHeap) Len() int { return len(h.idx) }
func (h *lsnHeap) Less(a, b int) bool {
	return h.ws[h.idx[a]].tok.Entries[0].LSN < h.ws[h.idx[b]].tok.Entries[0].LSN
}
func (h *lsnHeap) Swap(a, b int) { h.idx[a], h.idx[b] = h.idx[b], h.idx[a] }
func (h *lsnHeap) Push(x any)    { h.idx = append(h.idx, x.(int)) }
func (h *lsnHeap) Pop() any {
	x := h.idx[len(h.idx)-1]
	h.idx = h.idx[:len(h.idx)-1]
	return x
}

// jobCatchUp is one completed job of a stream: when it was enqueued,
// whether its token was caught up then, its first catch-up after that,
// and the run that completed it.
type jobCatchUp struct {
	enqueued time.Time
	atOnce   bool
	found    bool
	read     time.Time // CatchUp.Read of the first catch-up, if found
	start    time.Time // the completing run's handler start
	replica  string    // where the completing run read ("" primary)
	attempts int       // routing attempts the harness counted
}

// pauseSpan is a span during which replay was paused on every replica:
// from the moment the last of them reported its replay paused
// (pg_get_wal_replay_pause_state() = 'paused') to the first resume
// request. A job written and enqueued inside one cannot have been
// replayed anywhere before it ends.
type pauseSpan struct{ from, to time.Time }

func inSpans(t time.Time, ws []pauseSpan) bool {
	for _, w := range ws {
		if !t.Before(w.from) && t.Before(w.to) {
			return true
		}
	}
	return false
}

// latencyOf summarizes catch-up → start over the jobs of js that could not
// run at once and that keep selects.
func latencyOf(js []jobCatchUp, keep func(j *jobCatchUp) bool) latencyStats {
	var st latencyStats
	var ds, zeros []time.Duration
	for i := range js {
		j := &js[i]
		if j.atOnce || !keep(j) {
			continue
		}
		st.Jobs++
		if !j.found {
			st.Never++
			continue
		}
		d := j.start.Sub(j.read)
		if d < 0 {
			st.Early++
			if j.replica != "" {
				st.EarlyReplica++
			}
			zeros = append(zeros, 0)
			continue
		}
		ds = append(ds, d)
	}
	s := summarize(st.Jobs, ds)
	s.Early, s.EarlyReplica, s.Never = st.Early, st.EarlyReplica, st.Never
	s.N += len(zeros)
	if s.N > 0 {
		s.MeanEarlyZero = s.Mean * float64(len(ds)) / float64(s.N)
	}
	return s
}

// latencyStats summarizes catch-up → start latencies, in milliseconds.
type latencyStats struct {
	// Jobs is how many completed jobs the set has (lost jobs are reported
	// as lost); N how many of them the recorded snapshots show caught up,
	// the ones measured.
	Jobs int     `json:"jobs"`
	N    int     `json:"measured"`
	P50  float64 `json:"p50_ms"`
	P99  float64 `json:"p99_ms"`
	Max  float64 `json:"max_ms"`
	// P50, P99, Max and Mean are over the jobs that started at or after
	// their catch-up; MeanEarlyZero is the mean over every measured job,
	// those that started before it counting as 0.
	Mean          float64 `json:"mean_ms"`
	MeanEarlyZero float64 `json:"mean_early_as_0_ms"`
	// Early counts jobs whose completing run started before the recorded
	// catch-up: on the primary, or on a replica (EarlyReplica: a baseline's
	// stale read, or, for caughtup, a catch-up in a snapshot the follower
	// skipped). Never counts jobs never seen caught up.
	Early        int `json:"started_before_catch_up"`
	EarlyReplica int `json:"started_before_catch_up_on_a_replica"`
	Never        int `json:"never_caught_up"`
}

func summarize(jobs int, ds []time.Duration) latencyStats {
	st := latencyStats{Jobs: jobs, N: len(ds)}
	if len(ds) == 0 {
		return st
	}
	var sum time.Duration
	for _, d := range ds {
		sum += d
	}
	st.P50, st.P99, st.Max = ms(latency.Percentile(ds, 0.50)), ms(latency.Percentile(ds, 0.99)), ms(latency.Percentile(ds, 1))
	st.Mean = ms(sum / time.Duration(len(ds)))
	return st
}

// measureCatchUp sets the catch-up → start rows of sr from the jobs of st
// and the snapshots f recorded; paused are the spans during which replay
// was paused on every replica.
func measureCatchUp(sr *streamResult, st *stream, f *snapFollower, cfg *consume.Config, paused []pauseSpan) {
	js := st.catchUps(f, cfg)
	sr.CatchUp = latencyOf(js, func(*jobCatchUp) bool { return true })
	sr.Paused = latencyOf(js, func(j *jobCatchUp) bool { return inSpans(j.enqueued, paused) })
	sr.Deferred = latencyOf(js, func(j *jobCatchUp) bool { return j.attempts > 1 })
	sr.PausedDrain = drainOf(js, func(j *jobCatchUp) bool { return inSpans(j.enqueued, paused) })
}

// drainStats describes how a set of jobs that caught up together (the
// jobs enqueued during a replay pause, at its end) got started: how fast
// the catch-ups came and how fast the pipeline started the jobs. It is
// what bounds their catch-up → start latency: a job cannot start before
// the pipeline has started the ones ahead of it.
type drainStats struct {
	Jobs int `json:"jobs"`
	// CatchUpSpan is from the set's first catch-up to its 99th
	// percentile; StartSpan from the first catch-up to the last start.
	CatchUpSpan float64 `json:"catch_up_span_ms"`
	StartSpan   float64 `json:"start_span_ms"`
	// PeakRate is the most starts in any 100ms window, per second;
	// MeanRate the jobs over StartSpan.
	PeakRate float64 `json:"peak_starts_per_s"`
	MeanRate float64 `json:"mean_starts_per_s"`
}

// drainOf measures the drain of the jobs of js that could not run at once,
// were seen caught up and that keep selects.
func drainOf(js []jobCatchUp, keep func(j *jobCatchUp) bool) drainStats {
	var reads []time.Duration
	var starts []time.Time
	var first time.Time
	for i := range js {
		j := &js[i]
		if j.atOnce || !j.found || !keep(j) {
			continue
		}
		if first.IsZero() || j.read.Before(first) {
			first = j.read
		}
		starts = append(starts, j.start)
	}
	if len(starts) == 0 {
		return drainStats{}
	}
	for i := range js {
		j := &js[i]
		if !j.atOnce && j.found && keep(j) {
			reads = append(reads, j.read.Sub(first))
		}
	}
	d := drainStats{Jobs: len(starts), CatchUpSpan: ms(latency.Percentile(reads, 0.99))}
	last := starts[0]
	for _, t := range starts {
		if t.After(last) {
			last = t
		}
	}
	if span := last.Sub(first); span > 0 {
		d.StartSpan = ms(span)
		d.MeanRate = float64(len(starts)) / span.Seconds()
	}
	d.PeakRate = float64(maxInWindow(starts, 100*time.Millisecond)) * 10
	return d
}
