package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/caughtup/caughtup/replay"
)

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

func runWatch(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("watch --primary URL --replica [NAME=]URL [--replica ...] [--interval 1s] [--count N]\n\n"+
		"Shows what caughtup's tracker sees: each replica's replayed position, its lag\n"+
		"behind the primary in bytes and seconds, its epoch (system id/timeline) and\n"+
		"how fresh the observation is. Unknown state is shown as such: caughtup treats\n"+
		"it as infinitely behind. --replica takes replicas as caughtup feed and doctor do.", stdout)
	var replicas stringList
	primary := fs.String("primary", "", "primary connection string (postgres://…)")
	fs.Var(&replicas, "replica", replicaFlagHelp)
	interval := fs.Duration("interval", time.Second, "refresh interval")
	count := fs.Int("count", 0, "print this many refreshes and exit (0: until interrupted)")
	poll := fs.Duration("poll", replay.DefaultPollInterval, "tracker poll interval")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *primary == "" || len(replicas) == 0 {
		return usageError{"--primary and at least one --replica are required"}
	}
	if *interval <= 0 {
		return usageError{"--interval must be positive"}
	}
	named, err := parseReplicas(replicas)
	if err != nil {
		return err
	}
	conns := &pools{maxConns: 2}
	defer conns.close()
	pp, err := conns.connect(ctx, *primary)
	if err != nil {
		return err
	}
	db := replay.Database{Primary: pp}
	for _, r := range named {
		p, err := conns.connect(ctx, r.dsn)
		if err != nil {
			return err
		}
		db.Replicas = append(db.Replicas, replay.Replica{Name: r.name, Pool: p})
	}
	tracker, err := replay.NewTracker(ctx, map[string]replay.Database{"main": db},
		replay.TrackerConfig{PollInterval: *poll})
	if err != nil {
		return err
	}
	defer tracker.Close()

	tick := time.NewTicker(*interval)
	defer tick.Stop()
	for i := 0; *count == 0 || i < *count; i++ {
		if i > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-tick.C:
			}
		}
		printSnapshot(stdout, tracker.Snapshot(), tracker.Config(), time.Now())
	}
	return nil
}

// printSnapshot renders one tracker snapshot as a table.
func printSnapshot(w io.Writer, s *replay.Snapshot, cfg replay.TrackerConfig, now time.Time) {
	fmt.Fprintf(w, "%s  snapshot #%d\n", now.Format("15:04:05.000"), s.Seq)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tROLE\tPOSITION\tEPOCH\tLAG BYTES\tLAG TIME\tOBSERVED\tSTATE")
	for _, db := range s.Databases {
		p := db.Primary
		fmt.Fprintf(tw, "%s\tprimary\t%s\t%s\t-\t-\t%s\t%s\n", db.Name, p.InsertLSN, epochText(p.Epoch.IsZero(), p.Epoch.String()),
			ageText(p.ObservedAt, now), primaryState(p, cfg, now))
		for _, r := range db.Replicas {
			lagBytes := "unknown"
			if r.LagKnown {
				lagBytes = fmt.Sprint(r.LagBytes)
			}
			lagTime := "unknown"
			if !r.ReplayTimestamp.IsZero() {
				lagTime = r.TimeLag.Round(time.Millisecond).String()
			}
			fmt.Fprintf(tw, "%s\treplica\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, r.Replayed.LSN, epochText(r.Replayed.Epoch.IsZero(), r.Replayed.Epoch.String()),
				lagBytes, lagTime, ageText(r.ObservedAt, now), replicaState(r, cfg, now))
		}
	}
	tw.Flush()
}

func epochText(zero bool, s string) string {
	if zero {
		return "unknown"
	}
	return s
}

func ageText(at, now time.Time) string {
	if at.IsZero() {
		return "never"
	}
	return now.Sub(at).Round(time.Millisecond).String() + " ago"
}

func primaryState(p replay.PrimaryState, cfg replay.TrackerConfig, now time.Time) string {
	switch {
	case p.Err != nil:
		return "error: " + oneLine(p.Err.Error())
	case p.ObservedAt.IsZero() || now.Sub(p.ObservedAt) > cfg.StalenessBound:
		return "stale"
	case !p.HistoryKnown:
		return "ok (timeline history unknown)"
	}
	return "ok"
}

// replicaState says whether caughtup would use the replica, and if not why.
func replicaState(r replay.ReplicaState, cfg replay.TrackerConfig, now time.Time) string {
	switch {
	case r.Err != nil:
		return "unusable: " + oneLine(r.Err.Error())
	case r.ObservedAt.IsZero() || now.Sub(r.ObservedAt) > cfg.StalenessBound:
		return "unusable: observation stale"
	case !r.InRecovery:
		return "unusable: not in recovery (promoted)"
	case r.Replayed.LSN == 0:
		return "unusable: replay position unknown"
	case r.Replayed.Epoch.IsZero():
		return "unusable: epoch unknown"
	case !r.Healthy:
		return "unhealthy: over lag thresholds"
	}
	return "ok"
}
