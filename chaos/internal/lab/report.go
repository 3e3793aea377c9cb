package lab

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
)

// suiteResult is everything a run printed, as written to the JSON file.
type suiteResult struct {
	Mode           string            `json:"mode"`
	Kafka          string            `json:"kafka"`
	Interpretation string            `json:"interpretation"`
	Started        string            `json:"started"`
	Seconds        float64           `json:"elapsed_s"`
	Scenarios      []scenarioResult  `json:"scenarios"`
	Comparison     *comparisonResult `json:"comparison,omitempty"`
	Capacity       []capacityRow     `json:"capacity"`
	Failures       []string          `json:"failures"`
}

const interpretation = "each scenario pushes its job count in total, split evenly between an asynq pipeline and a kafka-go pipeline " +
	"(replay-pause: and a kafka-go retry-topic pipeline; adapters, adapters-pause, unreachable-replica: and River, with caughtupriver.Insert and with InsertTx, and franz-go; " +
	"lag-spike-cap: and River and franz-go) that run concurrently against one router (one per process, so one fallback cap); " +
	"stale = a handler read a version lower than its producer wrote (or no row); lost = produced and never completed"

func printScenario(w io.Writer, r scenarioResult) {
	fmt.Fprintf(w, "\n== %s: %s\n", r.Name, r.About)
	fmt.Fprintf(w, "   policy %s; %d jobs (%s); production %.1fs, scenario %.1fs; producer retries: %d writes, %d enqueues\n",
		r.Policy, r.Jobs, r.Split, r.ProduceSeconds, r.Seconds, r.WriteRetries, r.SendRetries)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "stream\tjobs\tstale\tlost\truns\treplica share\tprimary fallbacks\tdeferrals\tcapped\tcatch-up p50\tcatch-up p99\tmax fallback/1s (cap)\t")
	for _, s := range r.Streams {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%.1f%%\t%d\t%d\t%d\t%s\t%s\t%d (%d)\t\n",
			s.Stream, s.Jobs, s.Stale, s.Lost, s.Runs, 100*s.ReplicaShare, s.Fallbacks, s.Deferrals, s.Capped,
			fmtMS(s.LatencyP50), fmtMS(s.LatencyP99), s.MaxFallbackPerSec, r.CapWindowLimit)
	}
	_ = tw.Flush()
	printCatchUp(w, r)
	for _, e := range r.Events {
		fmt.Fprintf(w, "   +%6.1fs  %s\n", e.At, e.What)
	}
	for _, n := range r.Notes {
		fmt.Fprintf(w, "   note: %s\n", n)
	}
	for _, f := range r.Failures {
		fmt.Fprintf(w, "   FAIL: %s\n", f)
	}
}

// printCatchUp prints catch-up → handler start for the jobs that could
// not run at once, per pipeline.
func printCatchUp(w io.Writer, r scenarioResult) {
	fmt.Fprintf(w, "   catch-up -> handler start: from firstCaughtUp's Read (the tracker had read an observation of a replica past the token; "+
		"%d snapshots recorded, %d skipped) to the start of the run that completed the job\n", r.SnapshotsRecorded, r.SnapshotsSkipped)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "stream\tjobs\tp50\tp99\tmax\tmean\tbefore catch-up (replica)\tnever caught up\tretry count > 0 (no failure)\thandler errors\t")
	sets := []struct {
		name string
		get  func(s *streamResult) latencyStats
	}{
		{"not caught up when enqueued", func(s *streamResult) latencyStats { return s.CatchUp }},
		{"  enqueued while every replica was paused", func(s *streamResult) latencyStats { return s.Paused }},
		{"  routed more than once (deferred)", func(s *streamResult) latencyStats { return s.Deferred }},
	}
	for _, s := range r.Streams {
		for i, set := range sets {
			c := set.get(&s)
			if i > 0 && c.Jobs == 0 {
				continue
			}
			extra := "\t\t"
			if i == 0 {
				extra = fmt.Sprintf("%d (%d)\t%d", s.RetriedRuns, s.RetriedWithoutFailure, s.HandlerErrs)
			}
			fmt.Fprintf(tw, "%s: %s\t%d\t%s\t%s\t%s\t%s\t%d (%d)\t%d\t%s\t\n", s.Stream, set.name, c.Jobs,
				fmtMS(c.P50), fmtMS(c.P99), fmtMS(c.Max), fmtMS(c.Mean), c.Early, c.EarlyReplica, c.Never, extra)
		}
	}
	_ = tw.Flush()
	for _, s := range r.Streams {
		if d := s.PausedDrain; d.Jobs > 0 {
			fmt.Fprintf(w, "   %s: the %d jobs enqueued while every replica was paused caught up within %s (99%%); the pipeline started them all %s after the first catch-up: %.0f/s on average, at most %.0f/s over 100ms\n",
				s.Stream, d.Jobs, fmtMS(d.CatchUpSpan), fmtMS(d.StartSpan), d.MeanRate, d.PeakRate)
		}
	}
}

func printComparison(w io.Writer, c *comparisonResult) {
	fmt.Fprintf(w, "\n== comparison: %s\n", c.About)
	fmt.Fprintf(w, "   %d jobs (%s); %d pauses, %.1f replica-seconds paused; production %.1fs, total %.1fs\n",
		c.Jobs, c.Split, c.Pauses, c.PausedSeconds, c.ProduceSeconds, c.Seconds)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tstream\tjobs\tstale\tlost\treplica share\tprimary runs\tdeferrals/retries\tadded p50\tadded p99\t")
	row := func(pol string, s streamResult) {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%.1f%%\t%d\t%d\t%s\t%s\t\n", pol, s.Stream, s.Jobs, s.Stale, s.Lost, 100*s.ReplicaShare,
			s.PrimaryRuns, s.Deferrals, fmtMS(s.LatencyP50), fmtMS(s.LatencyP99))
	}
	for _, t := range c.Totals {
		for _, s := range c.Streams {
			if s.Policy == t.Policy {
				row(t.Policy, s)
			}
		}
		t.Stream = "all"
		row(t.Policy, t)
	}
	_ = tw.Flush()
	fmt.Fprintln(w, "   added = enqueue -> the handler's read (after routing, waits, deferrals and retries), of the run that completed the job")
	fmt.Fprintf(w, "   catch-up -> handler start, jobs enqueued while every replica was paused (%d pauses, %.1fs) whose token no replica had replayed then; "+
		"catch-up = firstCaughtUp's Read over the caughtup router's %d snapshots (%d skipped); mean and percentiles over the jobs started after it:\n",
		c.AllPaused, c.AllPausedSeconds, c.SnapshotsRecorded, c.SnapshotsSkipped)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tstream\tjobs\tmean\tp50\tp99\tmax\tstarted before catch-up: primary\treplica (stale)\tmean, those as 0\tnever caught up\t")
	crow := func(pol string, s streamResult) {
		p := s.Paused
		mean, p50, p99, mx := fmtMS(p.Mean), fmtMS(p.P50), fmtMS(p.P99), fmtMS(p.Max)
		if p.N == p.Early {
			mean, p50, p99, mx = "-", "-", "-", "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%d\t%d\t%s\t%d\t\n", pol, s.Stream, p.Jobs, mean, p50, p99, mx,
			p.Early-p.EarlyReplica, p.EarlyReplica, fmtMS(p.MeanEarlyZero), p.Never)
	}
	for _, t := range c.Totals {
		for _, s := range c.Streams {
			if s.Policy == t.Policy {
				crow(t.Policy, s)
			}
		}
		t.Stream = "all"
		crow(t.Policy, t)
	}
	_ = tw.Flush()
	if c.MeanRatio > 0 {
		fmt.Fprintf(w, "   GitLab-style mean / caughtup mean, every pipeline: %.1fx (%.1fx with jobs run before their catch-up as 0)\n", c.MeanRatio, c.MeanRatioEarlyZero)
	}
	if d := c.Drain; d != nil {
		fmt.Fprintf(w, "   drain, asynq: caughtup's largest burst, %d jobs, started %s after its first catch-up (mean start %s); plain asynq, %d tasks made pending at once, this run: %s (mean %s); drain ratio bare/caughtup %.2f\n",
			d.Caughtup.Jobs, fmtMS(d.Caughtup.Span), fmtMS(d.Caughtup.MeanStart), d.Bare.Jobs, fmtMS(d.Bare.Span), fmtMS(d.Bare.MeanStart), d.Ratio)
		if d.Ceiling > 0 {
			fmt.Fprintf(w, "   GitLab-style asynq mean %s over plain asynq's mean start %s: %.1fx, the most any policy could show here against it\n", fmtMS(d.GitLabMean), fmtMS(d.Bare.MeanStart), d.Ceiling)
		}
		if d.Error != "" {
			fmt.Fprintf(w, "   drain, bare side not measured: %s\n", d.Error)
		}
	}
	for _, f := range c.Failures {
		fmt.Fprintf(w, "   FAIL: %s\n", f)
	}
}

func fmtMS(ms float64) string {
	switch {
	case ms >= 10000:
		return fmt.Sprintf("%.1fs", ms/1000)
	case ms >= 1000:
		return fmt.Sprintf("%.2fs", ms/1000)
	default:
		return fmt.Sprintf("%.1fms", ms)
	}
}

func printSummary(w io.Writer, r *suiteResult) {
	fmt.Fprintf(w, "\n== summary (%s run, %.1fs)\n", r.Mode, r.Seconds)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tjobs\tstale\tlost\treplica share\tfallbacks\tdeferrals\tcapped\tcatch-up p50\tp99\tmax fallback/1s (cap)\tresult\t")
	for _, s := range r.Scenarios {
		t := s.Streams
		result := "ok"
		if len(s.Failures) > 0 {
			result = "FAIL"
		}
		if len(t) == 0 {
			fmt.Fprintf(tw, "%s\t\t\t\t\t\t\t\t\t\t\t%s\t\n", s.Name, result)
			continue
		}
		a := t[len(t)-1]
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.1f%%\t%d\t%d\t%d\t%s\t%s\t%d (%d)\t%s\t\n", s.Name, a.Jobs, a.Stale, a.Lost, 100*a.ReplicaShare,
			a.Fallbacks, a.Deferrals, a.Capped, fmtMS(a.LatencyP50), fmtMS(a.LatencyP99), a.MaxFallbackPerSec, s.CapWindowLimit, result)
	}
	_ = tw.Flush()
	if len(r.Failures) == 0 {
		fmt.Fprintln(w, "   0 stale reads and 0 lost jobs for caughtup in every scenario; the fallback cap held")
		return
	}
	for _, f := range r.Failures {
		fmt.Fprintf(w, "   FAIL: %s\n", f)
	}
}

func writeJSON(path string, r *suiteResult) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// collectFailures gathers every scenario's failures into the run's.
func (r *suiteResult) collectFailures() {
	r.Failures = r.Failures[:0]
	for _, s := range r.Scenarios {
		for _, f := range s.Failures {
			r.Failures = append(r.Failures, s.Name+": "+f)
		}
	}
	if r.Comparison != nil {
		for _, f := range r.Comparison.Failures {
			r.Failures = append(r.Failures, "comparison: "+f)
		}
	}
}
