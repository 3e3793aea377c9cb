package consume

import (
	"context"
	"log/slog"
	"time"

	"golang.org/x/time/rate"
)

func (r *Router) logDecision(ctx context.Context, d *Decision) {
	warn := false
	switch d.Reason {
	case ReasonMalformedToken, ReasonEpoch, ReasonNoHealthyReplica, ReasonTrackerStale, ReasonUnknownDatabase, ReasonCapped:
		warn = true
	}
	level := slog.LevelDebug
	if warn {
		level = slog.LevelWarn
	}
	if !r.log.Enabled(ctx, level) {
		return
	}
	emit := func() {
		attrs := make([]slog.Attr, 0, 8+2*len(d.Databases))
		attrs = append(attrs,
			slog.String("db.system.name", "postgresql"),
			slog.String(attrPolicy, d.Policy.String()),
			slog.String(attrOutcome, d.Outcome.String()),
			slog.String(attrReason, d.Reason.String()),
			slog.Duration("caughtup.token_age", d.TokenAge),
		)
		if d.Waited > 0 {
			attrs = append(attrs, slog.Duration("caughtup.waited", d.Waited))
		}
		if d.Action == ActionDefer || d.Action == ActionRefuse {
			attrs = append(attrs, slog.Duration("caughtup.delay", d.Delay))
		}
		for _, dd := range d.Databases {
			g := []any{
				slog.String(attrOutcome, dd.Outcome.String()),
				slog.String(attrReason, dd.Reason.String()),
			}
			if dd.Replica != "" {
				g = append(g, slog.String(attrReplica, dd.Replica))
			}
			if dd.BytesBehind > 0 {
				g = append(g, slog.Uint64("caughtup.bytes_behind", dd.BytesBehind))
			}
			if dd.Reason == ReasonEpoch {
				g = append(g, slog.String("caughtup.incomparable", dd.Incomparable.String()))
			}
			attrs = append(attrs, slog.Group(attrDatabase+"."+dd.Database, g...))
		}
		r.log.LogAttrs(ctx, level, "caughtup: routed job", attrs...)
	}
	if !warn {
		emit()
		return
	}
	// Degraded state tends to hit every job at once; metrics count each,
	// the log samples.
	r.warnMu.Lock()
	s := r.warns[d.Reason]
	if s == nil {
		s = &rate.Sometimes{First: 3, Interval: 10 * time.Second}
		r.warns[d.Reason] = s
	}
	r.warnMu.Unlock()
	s.Do(emit)
}
