package lab

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/testkit/catchup"
	"github.com/caughtup/caughtup/testkit/latency"
)

// payload is what every job carries: the row its producer wrote and the
// version that write produced, and when the write committed and the job
// was handed to the queue.
type payload struct {
	ID        int64 `json:"id"`
	Key       int64 `json:"k"`
	Version   int64 `json:"v"`
	Committed int64 `json:"c"` // Unix ns, right after COMMIT and the position capture
	Enqueued  int64 `json:"e"` // Unix ns, right before the enqueue call
}

func (p payload) encode() []byte {
	b, _ := json.Marshal(p)
	return b
}

func decodePayload(b []byte) (payload, error) {
	var p payload
	err := json.Unmarshal(b, &p)
	return p, err
}

// read is one handler run: where the job read and what it saw.
type read struct {
	job payload
	// at is when the handler read, after routing (and, for the
	// baselines, after their own checks and sleeps).
	at time.Time
	// decided is when the routing decision was made: for caughtup the
	// Decision's clock (token capture time + Decision.TokenAge), for the
	// baselines the read time.
	decided  time.Time
	replica  string // "" is the primary
	fallback bool   // caughtup promoted the job for lag or unknown replica state
	outcome  string
	reason   string
	got      int64 // version read; -1 when the row was missing
	stale    bool
	// timeline is the timeline of the job's token (0 without one);
	// waited is how long the router waited for a replica
	// (Decision.Waited).
	timeline uint32
	waited   time.Duration
	// retried is the queue's own retry count of the run (asynq's
	// GetRetryCount, caughtupkafka.Attempt): deferrals must not grow it.
	retried int
}

// stream is one consumer pipeline: a queue (asynq) or a consumer group
// (Kafka) read with one routing policy. The checker keeps every read and
// every completion of it.
type stream struct {
	name   string // "asynq", "kafka", "asynq/gitlab", ...
	pipe   string // "asynq" or "kafka"
	policy string // "caughtup", "gitlab", "window"

	mu          sync.Mutex
	produced    map[int64]payload
	completed   map[int64]time.Time // first successful run
	reads       []read
	stale       []read
	deferrals   int // the job did not run now: deferred for lag (caughtup) or retried through the queue (gitlab)
	capped      int // refused by the fallback cap
	errors      int // handler runs that failed (a replica killed under a read, a primary going away)
	deadLetters int
	// replicaFailed counts handler runs whose read failed because a
	// replica the router chose failed it (consume.ReplicaFailed): the
	// adapter routes those again without spending an attempt.
	replicaFailed int
	// pastDeadline counts asynq deferrals whose delay (plus the
	// middleware's slack) outlasts the attempt's deadline, by the
	// attempt's time limit.
	pastDeadline map[time.Duration]int
	// tokens are the tokens the jobs were enqueued with, and attempts
	// how many times caughtup's pipelines began routing each job (the
	// harness's wrappers count them; deferrals and in-place waits
	// included), for the catch-up → start latency.
	tokens   map[int64]position.Token
	attempts map[int64]int
	// failed are the jobs with an attempt that failed (a handler error;
	// for asynq also a refusal by the fallback cap, and a retry asynq made
	// for its own reasons, such as a lease that expired while Redis was
	// down): the only reasons a queue may grow a job's retry count.
	failed map[int64]bool
	// leaseExpired counts the retries asynq made for an expired lease
	// (its recoverer, after a Redis outage kept it from writing a task's
	// state): a job that comes back that way is late, not lost.
	leaseExpired int
}

func newStream(name, pipe, policy string) *stream {
	return &stream{name: name, pipe: pipe, policy: policy, produced: map[int64]payload{}, completed: map[int64]time.Time{},
		pastDeadline: map[time.Duration]int{}, tokens: map[int64]position.Token{}, attempts: map[int64]int{},
		failed: map[int64]bool{}}
}

// attempt records that a routing attempt of job id begins.
func (s *stream) attempt(id int64) {
	s.mu.Lock()
	s.attempts[id]++
	s.mu.Unlock()
}

// attempted records how an attempt of job id ended: err is what the
// adapter got back (nil, a deferral, or a failure).
func (s *stream) attempted(id int64, err error) {
	var de *consume.DeferError
	if err == nil || errors.As(err, &de) && !de.Refused() {
		return
	}
	s.mu.Lock()
	s.failed[id] = true
	if errors.Is(err, asynq.ErrLeaseExpired) {
		s.leaseExpired++
	}
	s.mu.Unlock()
}

// replicaFailedRun records a handler run a replica failed
// (consume.ReplicaFailed).
func (s *stream) replicaFailedRun() {
	s.mu.Lock()
	s.replicaFailed++
	s.mu.Unlock()
}

// addProduced records a job enqueued with tok.
func (s *stream) addProduced(p payload, tok position.Token) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.produced[p.ID] = p
	s.tokens[p.ID] = tok
}

// record keeps a read and marks the job complete; the handler then
// returns nil, so the queue considers the job done.
func (s *stream) record(r read) {
	r.stale = r.got < r.job.Version
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reads = append(s.reads, r)
	if r.stale {
		s.stale = append(s.stale, r)
	}
	if _, ok := s.completed[r.job.ID]; !ok {
		s.completed[r.job.ID] = r.at
	}
}

func (s *stream) count(deferral, capped, failed, dead int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.deferrals += deferral
	s.capped += capped
	s.errors += failed
	s.deadLetters += dead
}

// jobs is how many jobs were produced into the stream.
func (s *stream) jobs() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.produced)
}

// rejudge replaces the staleness rule for the reads isStale answers for
// (ok true), leaving the others as record judged them.
func (s *stream) rejudge(isStale func(r read) (stale, ok bool)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stale = s.stale[:0]
	for i := range s.reads {
		if st, ok := isStale(s.reads[i]); ok {
			s.reads[i].stale = st
		}
		if s.reads[i].stale {
			s.stale = append(s.stale, s.reads[i])
		}
	}
}

// pending is how many produced jobs have not completed yet.
func (s *stream) pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for id := range s.produced {
		if _, ok := s.completed[id]; !ok {
			n++
		}
	}
	return n
}

// leaseExpiredRetries is how many retries asynq made for an expired lease.
func (s *stream) leaseExpiredRetries() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.leaseExpired
}

// unfinished are the produced jobs that have not completed yet, with how
// many routing attempts each began, in id order.
func (s *stream) unfinished() (ids []int64, attempts []int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id := range s.produced {
		if _, ok := s.completed[id]; !ok {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	for _, id := range ids {
		attempts = append(attempts, s.attempts[id])
	}
	return ids, attempts
}

// streamResult is what one stream measured.
type streamResult struct {
	Stream       string  `json:"stream"`
	Policy       string  `json:"policy"`
	Jobs         int     `json:"jobs"`
	Completed    int     `json:"completed"`
	Lost         int     `json:"lost"`
	Runs         int     `json:"runs"`
	Stale        int     `json:"stale_reads"`
	ReplicaRuns  int     `json:"replica_runs"`
	ReplicaShare float64 `json:"replica_share"`
	PrimaryRuns  int     `json:"primary_runs"`
	Fallbacks    int     `json:"primary_fallbacks"`
	Deferrals    int     `json:"deferrals"`
	Capped       int     `json:"capped"`
	HandlerErrs  int     `json:"handler_errors"`
	DeadLetters  int     `json:"dead_letters"`
	// ReplicaFailed counts handler runs a replica the router chose failed
	// (consume.ReplicaFailed), which the adapters route again without
	// spending an attempt; the asynq and River middlewares do that before
	// their runs end, so those are not among HandlerErrs.
	ReplicaFailed int `json:"replica_failed_runs"`
	// Latency (the scenario tables' catch-up latency, the comparison's
	// added latency) is enqueue → the handler's read, after routing and
	// any waits, deferrals and retries, of the run that completed the job.
	// CommitToRead starts at the producer's commit instead, which is
	// earlier for jobs enqueued late on purpose. Milliseconds.
	LatencyP50      float64 `json:"latency_p50_ms"`
	LatencyP99      float64 `json:"latency_p99_ms"`
	CommitToReadP50 float64 `json:"commit_to_read_p50_ms"`
	CommitToReadP99 float64 `json:"commit_to_read_p99_ms"`
	// MaxFallbackPerSec is the most fallback primary reads whose
	// decisions fall in any window [t, t+1s); MaxPrimaryPerSec the same
	// for every primary read.
	// CatchUp is catch-up → handler start of the jobs that could not run
	// at once: their token not caught up in the router's snapshot when
	// they were enqueued. Paused is the same for those of them enqueued
	// while replay was paused on every replica, Deferred for those routed
	// more than once (deferred, or waited in place again). Set by the
	// scenario from its recorded snapshots (see catchup.go).
	CatchUp  latencyStats `json:"catch_up_to_start"`
	Paused   latencyStats `json:"catch_up_to_start_paused"`
	Deferred latencyStats `json:"catch_up_to_start_deferred"`
	// PausedDrain is how the jobs of Paused caught up and were started.
	PausedDrain drainStats `json:"paused_drain"`
	// RetriedRuns counts completing runs whose queue retry count
	// (asynq.GetRetryCount, caughtupkafka.Attempt) was above 0: a
	// deferral must never grow it, so without handler errors
	// (HandlerErrs) it must be 0.
	RetriedRuns int `json:"completed_with_retry_count"`
	// RetriedWithoutFailure counts those of them whose job had no failed
	// attempt (see stream.failed) in caughtup's pipelines: a retry count
	// grown by deferrals alone. Must be 0.
	RetriedWithoutFailure int            `json:"completed_with_retry_count_without_failure"`
	MaxFallbackPerSec     int            `json:"max_fallback_reads_per_1s"`
	MaxPrimaryPerSec      int            `json:"max_primary_reads_per_1s"`
	Outcomes              map[string]int `json:"outcomes"`
	StaleExamples         []string       `json:"stale_examples,omitempty"`
	LostExamples          []int64        `json:"lost_examples,omitempty"`
}

func (s *stream) result() streamResult {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := streamResult{
		Stream: s.name, Policy: s.policy, Jobs: len(s.produced), Runs: len(s.reads), Stale: len(s.stale),
		Deferrals: s.deferrals, Capped: s.capped, HandlerErrs: s.errors, ReplicaFailed: s.replicaFailed, DeadLetters: s.deadLetters,
		Outcomes: map[string]int{},
	}
	var sinceCommit, sinceEnqueue []time.Duration
	var fallbackAt, primaryAt []time.Time
	first := map[int64]bool{}
	for _, rd := range s.reads {
		r.Outcomes[rd.outcome]++
		if rd.replica != "" {
			r.ReplicaRuns++
		} else {
			r.PrimaryRuns++
			primaryAt = append(primaryAt, rd.decided)
			if rd.fallback {
				r.Fallbacks++
				fallbackAt = append(fallbackAt, rd.decided)
			}
		}
		if !first[rd.job.ID] && s.completed[rd.job.ID].Equal(rd.at) {
			first[rd.job.ID] = true
			if rd.retried > 0 {
				r.RetriedRuns++
				if !s.failed[rd.job.ID] {
					r.RetriedWithoutFailure++
				}
			}
			sinceCommit = append(sinceCommit, rd.at.Sub(time.Unix(0, rd.job.Committed)))
			sinceEnqueue = append(sinceEnqueue, rd.at.Sub(time.Unix(0, rd.job.Enqueued)))
		}
	}
	if r.Runs > 0 {
		r.ReplicaShare = float64(r.ReplicaRuns) / float64(r.Runs)
	}
	for id := range s.produced {
		if _, ok := s.completed[id]; ok {
			r.Completed++
		} else {
			r.Lost++
			if len(r.LostExamples) < 10 {
				r.LostExamples = append(r.LostExamples, id)
			}
		}
	}
	slices.Sort(r.LostExamples)
	r.LatencyP50, r.LatencyP99 = ms(latency.Percentile(sinceEnqueue, 0.50)), ms(latency.Percentile(sinceEnqueue, 0.99))
	r.CommitToReadP50, r.CommitToReadP99 = ms(latency.Percentile(sinceCommit, 0.50)), ms(latency.Percentile(sinceCommit, 0.99))
	r.MaxFallbackPerSec = maxInWindow(fallbackAt, time.Second)
	r.MaxPrimaryPerSec = maxInWindow(primaryAt, time.Second)
	for i, rd := range s.stale {
		if i == 10 {
			break
		}
		where := rd.replica
		if where == "" {
			where = "primary"
		}
		r.StaleExamples = append(r.StaleExamples, fmt.Sprintf("job %d key %d: read version %d on %s, producer wrote %d (outcome %s, reason %s)",
			rd.job.ID, rd.job.Key, rd.got, where, rd.job.Version, rd.outcome, rd.reason))
	}
	return r
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// maxInWindow is the largest number of times in any half-open window
// [t, t+w). A token bucket of rate r and burst b admits at most b + r·w
// in any such window, which is what the cap check compares it with.
func maxInWindow(ts []time.Time, w time.Duration) int {
	if len(ts) == 0 {
		return 0
	}
	s := slices.Clone(ts)
	sort.Slice(s, func(i, j int) bool { return s[i].Before(s[j]) })
	best, lo := 0, 0
	for hi := range s {
		for s[hi].Sub(s[lo]) >= w {
			lo++
		}
		best = max(best, hi-lo+1)
	}
	return best
}

// catchUps finds, for every job of s that completed, whether its token
// was caught up when it was enqueued (in the last snapshot f had seen
// then) and, if not, its first catch-up after that in f's snapshots.
func (s *stream) catchUps(f *snapFollower, cfg *consume.Config) []jobCatchUp {
	s.mu.Lock()
	defer s.mu.Unlock()
	completing := s.completingReads()
	js := make([]jobCatchUp, 0, len(completing))
	one := make([]*replay.Snapshot, 1)
	var ws []waiting
	var idx []int
	for id, rd := range completing {
		p := s.produced[id]
		j := jobCatchUp{enqueued: time.Unix(0, p.Enqueued), start: rd.at, replica: rd.replica, attempts: s.attempts[id]}
		tok := s.tokens[id]
		i := f.at(j.enqueued)
		var after uint64
		if i >= 0 {
			one[0] = f.snaps[i]
			_, j.atOnce = catchup.FirstCaughtUp(tok, one, cfg)
			after = f.snaps[i].Seq
		}
		if !j.atOnce {
			ws = append(ws, waiting{tok: tok, after: after})
			idx = append(idx, len(js))
		}
		js = append(js, j)
	}
	firstCatchUps(ws, f.snaps, cfg)
	for k, w := range ws {
		js[idx[k]].found, js[idx[k]].read = w.found, w.read
	}
	return js
}

// completingReads maps each completed job to the run that completed it.
// The caller holds s.mu.
func (s *stream) completingReads() map[int64]read {
	out := make(map[int64]read, len(s.completed))
	for _, rd := range s.reads {
		if _, ok := out[rd.job.ID]; !ok && s.completed[rd.job.ID].Equal(rd.at) {
			out[rd.job.ID] = rd
		}
	}
	return out
}

// readsBetween returns the reads decided in (from, to).
func (s *stream) readsBetween(from, to time.Time) []read {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []read
	for _, r := range s.reads {
		if r.decided.After(from) && r.decided.Before(to) {
			out = append(out, r)
		}
	}
	return out
}
