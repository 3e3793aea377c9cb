package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/caughtup/caughtup/consume"
)

// view prints progress until ctx ends: redrawn in place on a terminal,
// a line every few seconds otherwise.
func (a *app) view(ctx context.Context, began time.Time) {
	every := 3 * time.Second
	if a.opts.Live {
		every = 500 * time.Millisecond
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	lines := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		elapsed := time.Since(began).Round(time.Second)
		if !a.opts.Live {
			fmt.Fprintf(a.opts.Out, "%5s  %s  %s\n", elapsed, a.phase(elapsed), a.summaryLine())
			continue
		}
		var b strings.Builder
		a.render(&b, elapsed)
		if lines > 0 {
			fmt.Fprintf(a.opts.Out, "\x1b[%dA\x1b[J", lines)
		}
		fmt.Fprint(a.opts.Out, b.String())
		lines = strings.Count(b.String(), "\n")
	}
}

func (a *app) phase(elapsed time.Duration) string {
	o := a.opts
	switch {
	case elapsed >= o.Duration:
		return "draining       "
	case elapsed >= o.SpikeAt && elapsed < o.SpikeAt+o.SpikeFor:
		return "LAG SPIKE      "
	case o.FailoverAt >= 0 && elapsed >= o.FailoverAt && elapsed < o.FailoverAt+3*time.Second:
		return "FAILOVER       "
	}
	return "steady traffic "
}

func (a *app) summaryLine() string {
	fh, fs := a.fresh.counts()
	dh, ds := a.direct.counts()
	out := a.outcomes()
	return fmt.Sprintf("requests=%d  with caughtup: handled=%d stale=%d (replica=%d waited=%d deferred=%d primary=%d)  without: handled=%d stale=%d",
		a.requests.Load(), fh, fs, out[consume.OutcomeReplica.String()], out[consume.OutcomeReplicaWaited.String()], out[consume.OutcomeDeferred.String()],
		out[consume.OutcomePrimary.String()]+out[consume.OutcomePrimaryNoToken.String()]+out[consume.OutcomePrimaryEpoch.String()], dh, ds)
}

func (a *app) render(w io.Writer, elapsed time.Duration) {
	fmt.Fprintf(w, "caughtup demo  %s  [%s]  requests %d\n\n", elapsed, strings.TrimSpace(a.phase(elapsed)), a.requests.Load())
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "replica\treplayed\tepoch\tlag bytes\tlag time\tstate")
	snap := a.router.Snapshot()
	if db := snap.Database("main"); db != nil {
		for _, r := range db.Replicas {
			state := "ok"
			switch {
			case r.Err != nil:
				state = "unreachable"
			case !r.InRecovery:
				state = "promoted (excluded)"
			}
			lag := "?"
			if r.LagKnown {
				lag = fmt.Sprint(r.LagBytes)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, r.Replayed.LSN, r.Replayed.Epoch, lag, r.TimeLag.Round(time.Millisecond), state)
		}
	}
	tw.Flush()
	out := a.outcomes()
	keys := make([]string, 0, len(out))
	for k := range out {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	fmt.Fprint(w, "\ndecisions:")
	for _, k := range keys {
		fmt.Fprintf(w, "  %s=%d", k, out[k])
	}
	fh, fs := a.fresh.counts()
	dh, ds := a.direct.counts()
	fmt.Fprintf(w, "\nwith caughtup: handled %d, stale reads %d\nwithout:       handled %d, stale reads %d\n", fh, fs, dh, ds)
}

func printFinal(w io.Writer, r Result) {
	fmt.Fprintf(w, "\nfinal: %d profile updates (%d committed; the rest failed during the failover), each consumed as an asynq job and as an outbox event on Kafka, by both paths\n", r.Requests, r.Committed)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\twith caughtup\twithout\t")
	row := func(name string, f func(Side) any) {
		fmt.Fprintf(tw, "%s\t%v\t%v\t\n", name, f(r.Caughtup), f(r.Without))
	}
	row("asynq jobs handled", func(s Side) any { return s.Jobs })
	row("kafka events handled", func(s Side) any { return s.Events })
	row("lost", func(s Side) any { return s.Lost })
	row("stale reads", func(s Side) any { return s.Stale })
	row("handler runs", func(s Side) any { return s.Runs })
	row("reads on a replica", func(s Side) any { return s.ReplicaRuns })
	row("reads on the primary", func(s Side) any { return s.PrimaryRun })
	row("deferrals", func(s Side) any { return s.Deferred })
	tw.Flush()
	if r.Failover {
		fmt.Fprintf(w, "failover: the primary is now on timeline %d\n", r.TimelineB)
	}
	verdict := "OK: no stale read and nothing lost with caughtup; the same traffic without it read stale data"
	if !r.OK() {
		verdict = "UNEXPECTED: see the table"
	}
	fmt.Fprintf(w, "%s (%s)\n", verdict, r.Elapsed.Round(time.Second))
}
